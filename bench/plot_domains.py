"""A run's held-out pass@1 per domain before and after RL, with the 95% intervals, as one bar chart.

    .venv/bin/python bench/plot_domains.py RUN_DIR OUT.png [--title TEXT]

Reads RUN_DIR/summary.json (`per_domain_before|after`, `intervals.sampled.<domain>.before|after`, each [low, high]): what a
dated results page shows for a many-domain run (docs/img/smollm2-domains.png).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--title", default="held-out pass@1 per domain, before and after RL (95% CI)")
    args = parser.parse_args()
    summary = json.loads((args.run_dir / "summary.json").read_text())
    intervals = summary["intervals"]["sampled"]
    domains = sorted(summary["per_domain_before"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(domains) + 2), 4.2))
    width = 0.4
    for offset, when, color in ((-width / 2, "before", "#9aa5b1"), (width / 2, "after", "#2f6f9f")):
        values = [100 * summary[f"per_domain_{when}"][d] for d in domains]
        low = [v - 100 * intervals[d][when][0] for v, d in zip(values, domains)]
        high = [100 * intervals[d][when][1] - v for v, d in zip(values, domains)]
        xs = [i + offset for i in range(len(domains))]
        ax.bar(xs, values, width, color=color, label=f"{when} RL")
        ax.errorbar(xs, values, yerr=[low, high], fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
    ax.set_xticks(range(len(domains)), domains, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("pass@1, sampled (%)")
    ax.set_ylim(0, 100)
    ax.set_title(args.title, fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
