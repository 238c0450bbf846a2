"""Every policy-optimisation method on the default recipe at equal RL wall clock, from one SFT model, over
seeds: the comparison users look for.

    .venv/bin/python bench/algo_compare.py [--budget-s 180] [--seeds 0 1] [--algos grpo dapo ...]
                                           [--sft DIR] [--out runs/algo_compare] [--docs]

Runs the SFT stage of configs/tiny-code.yaml once (or reuses --sft, a model directory), then for each recipe
in configs/algos/ and each seed runs RL for --budget-s seconds of wall clock (`train.max_time_s`) and
evaluates on the 512 held-out tasks (4 samples at T=1, and greedy). A finished run is reused (delete its
directory to redo it). Printed as a markdown table: steps done, held-out sampled pass@1 after RL with its
95% bootstrap interval over problems, the gain over the SFT start with its paired interval, greedy pass@1,
sampled pass@1 per domain, and entropy and response length at the end (means of the last 10 steps).
`--docs` writes the table to a dated results page, docs/results/YYYY-MM-DD-algo-compare.md (today's date
and this checkout's commit in its head), and the plot (sampled pass@1 and its interval per method and seed)
to docs/img/algo_compare-YYYY-MM-DD.png; add the page to the Results section of mkdocs.yml's nav.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from tempering.eval.intervals import format_gain

ALGOS = ["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo_gae", "gspo", "cispo"]
ROOT = Path(__file__).resolve().parent.parent


def tempering(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tempering.cli", *args], check=True, cwd=ROOT)


def reuse_eval_before(run_dir: Path, out: Path, seed: int) -> None:
    """The evaluation before RL is the same for every run of a seed that starts from one model (same model,
    tasks, seed, settings: the run checks its recorded key and evaluates again if anything differs), so
    a run of `out` copies the first one's (`out/*-s{seed}/eval_before.json`)."""
    done = sorted(out.glob(f"*-s{seed}/eval_before.json"))
    if done and not (run_dir / "eval_before.json").is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "eval_before.json").write_bytes(done[0].read_bytes())


def run(algo: str, seed: int, sft: Path, out: Path, budget_s: float) -> dict:
    run_dir = out / f"{algo}-s{seed}"
    if not (run_dir / "summary.json").is_file():
        reuse_eval_before(run_dir, out, seed)
        tempering(
            "train",
            f"configs/algos/{algo}.yaml",
            f"model.path={sft}",
            "sft.steps=0",
            f"run.dir={run_dir}",
            f"run.seed={seed}",
            "train.steps=100000",
            f"train.max_time_s={budget_s}",
            "eval.every=0",
            "checkpoint.every=100000",
            "tracking.progress=false",
            "tracking.samples_every=0",
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def last(key: str) -> float:
        values = [r[key] for r in rows[-10:] if isinstance(r.get(key), int | float)]
        return sum(values) / max(1, len(values))

    return {
        "algo": algo,
        "seed": seed,
        "summary": summary,
        "steps": len(rows),
        "entropy": last("actor/entropy"),
        "length": last("response_length/mean"),
    }


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table(results: list[dict], budget_s: float) -> str:
    domains = list(results[0]["summary"]["per_domain_after"])
    head = [
        "method",
        "seed",
        "steps",
        "sampled pass@1 [95% CI]",
        "gain [95% CI]",
        "greedy",
        *domains,
        "entropy",
        "length",
    ]
    lines = [
        f"Held-out pass@1 (%) on {results[0]['summary']['heldout_tasks']} tasks never trained on, after "
        f"{budget_s:.0f} s of RL from the same SFT model (sampled before RL: "
        f"{pct(results[0]['summary']['heldout_pass@1_before'])}, greedy "
        f"{pct(results[0]['summary']['heldout_greedy_pass@1_before'])}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results:
        s = r["summary"]
        iv = s.get("intervals", {}).get("sampled", {}).get("all", {})
        after, gain = iv.get("after"), iv.get("gain")
        cells = [
            r["algo"],
            str(r["seed"]),
            str(r["steps"]),
            pct(s["heldout_pass@1_after"]) + (f" [{pct(after[0])}, {pct(after[1])}]" if after else ""),
            format_gain(gain),
            pct(s["heldout_greedy_pass@1_after"]),
            *(pct(s["per_domain_after"][d]) for d in domains),
            f"{r['entropy']:.3f}",
            f"{r['length']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = list(dict.fromkeys(r["algo"] for r in results))
    seeds = sorted({r["seed"] for r in results})
    width = 0.8 / len(seeds)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for j, seed in enumerate(seeds):
        xs, ys, low, high = [], [], [], []
        for i, algo in enumerate(algos):
            for r in results:
                if r["algo"] == algo and r["seed"] == seed:
                    s = r["summary"]
                    y = s["heldout_pass@1_after"]
                    ci = s.get("intervals", {}).get("sampled", {}).get("all", {}).get("after", [y, y])
                    xs.append(i + (j - (len(seeds) - 1) / 2) * width)
                    ys.append(y)
                    low.append(y - ci[0])
                    high.append(ci[1] - y)
        ax.bar(xs, ys, width, yerr=[low, high], capsize=3, label=f"seed {seed}")
    before = results[0]["summary"]["heldout_pass@1_before"]
    ax.axhline(before, color="grey", ls="--", lw=1, label="SFT start")
    ax.set_xticks(range(len(algos)), algos)
    ax.set_ylabel("held-out sampled pass@1")
    ax.set_title("equal RL wall clock, same SFT start (95% bootstrap intervals)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-s", type=float, default=180.0, help="RL wall-clock budget per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default="runs/algo_compare")
    parser.add_argument("--sft", help="an SFT model directory to start from (default: run the SFT stage)")
    parser.add_argument("--algos", nargs="+", default=ALGOS)
    parser.add_argument("--docs", action="store_true", help="write a dated results page and its plot")
    args = parser.parse_args()
    out = ROOT / args.out
    sft = Path(args.sft) if args.sft else out / "sft" / "sft" / "model"
    if not args.sft and not sft.is_dir():
        tempering("sft", "configs/tiny-code.yaml", f"run.dir={out / 'sft'}")
    results = [run(algo, seed, sft, out, args.budget_s) for algo in args.algos for seed in args.seeds]
    text = table(results, args.budget_s)
    print(text)
    plot(results, out / "algo_compare.png")
    if args.docs:
        today = datetime.date.today().isoformat()
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        plot(results, ROOT / "docs" / "img" / f"algo_compare-{today}.png")
        page = ROOT / "docs" / "results" / f"{today}-algo-compare.md"
        page.write_text(
            f"# {today}: algorithms compared at equal wall clock\n\n*Measured at commit `{commit}`.*\n\n"
            f"`.venv/bin/python bench/algo_compare.py --budget-s {args.budget_s:.0f} --seeds "
            f"{' '.join(map(str, args.seeds))} --docs` ({os.cpu_count()} cores).\n\n{text}\n"
            f"![Held-out pass@1 per method and seed](../img/algo_compare-{today}.png)\n"
        )
        print(f"wrote {page.relative_to(ROOT)}: add it to mkdocs.yml's Results nav")


if __name__ == "__main__":
    main()
