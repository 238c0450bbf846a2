"""A recipe on several seeds: `tempering train CONFIG run.seed=S` for each seed, then one table of what
each seed gained - held-out sampled and greedy pass@1 before and after RL with the paired 95% intervals,
the domains that fell beyond their interval, SFT's steps and the wall time.

    .venv/bin/python bench/seeds.py configs/tiny-code.yaml [--seeds 0 1 2] [--out runs/seeds-NAME]
                                    [--record results/NAME-seeds.json]

Seed S runs in OUT/sS (a finished run is reused: delete it to redo it); the recipe is otherwise untouched,
so seed 0 is what `make demo` runs. The record's value is the mean sampled gain over the seeds, with each
seed's gain and interval, the smallest gain and the wall times among its values.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from record import write_record

from tempering.eval.intervals import format_gain

ROOT = Path(__file__).resolve().parent.parent


def run_seed(config: str, seed: int, run_dir: Path) -> float | None:
    """Train seed `seed` into `run_dir` unless it is done; the wall time of this call's run (None: reused)."""
    if (run_dir / "summary.json").is_file():
        return None
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tempering.cli", "train", config, f"run.dir={run_dir}", f"run.seed={seed}",
         "tracking.progress=false"],
        check=True, cwd=ROOT,
    )  # fmt: skip
    return time.perf_counter() - began


def row(seed: int, summary: dict) -> tuple[str, dict[str, float]]:
    iv = summary["intervals"]
    gain, greedy = iv["sampled"]["all"]["gain"], iv["greedy"]["all"]["gain"]
    domains = {d: v["gain"] for d, v in iv["sampled"].items() if d != "all"}
    down = [f"{d} {format_gain(g)}" for d, g in domains.items() if g[2] < 0]
    weakest = min(domains, key=lambda d: domains[d][0])
    wall = summary["wall_time_s"]
    line = (
        f"| {seed} | {summary.get('sft_steps', '-')} | {100 * summary['heldout_pass@1_before']:.1f}% | "
        f"{100 * summary['heldout_pass@1_after']:.1f}% | {format_gain(gain)} | "
        f"{100 * summary['heldout_greedy_pass@1_before']:.1f}% -> "
        f"{100 * summary['heldout_greedy_pass@1_after']:.1f}% {format_gain(greedy)} | "
        f"{weakest} {format_gain(domains[weakest])} | {', '.join(down) or 'none'} | "
        f"{int(wall // 60)} min {int(wall % 60)} s |"
    )
    figures = {
        f"gain_s{seed}": 100 * gain[0],
        f"gain_low_s{seed}": 100 * gain[1],
        f"greedy_gain_s{seed}": 100 * greedy[0],
        f"domains_down_s{seed}": len(down),
        f"wall_min_s{seed}": wall / 60,
    }
    return line, figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", help="default runs/seeds-<config name>")
    parser.add_argument("--record", metavar="PATH", help="also write the gains as a result record")
    args = parser.parse_args()
    name = Path(args.config).stem
    out = ROOT / (args.out or f"runs/seeds-{name}")
    lines = [
        "| seed | SFT steps | sampled before | sampled after | gain [95% CI] | greedy before -> after "
        "[95% CI] | weakest domain | domains down beyond their interval | wall time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    figures: dict[str, float] = {}
    for seed in args.seeds:
        run_seed(args.config, seed, out / f"s{seed}")
        line, seed_figures = row(seed, json.loads((out / f"s{seed}" / "summary.json").read_text()))
        lines.append(line)
        figures |= seed_figures
    gains = [figures[f"gain_s{s}"] for s in args.seeds]
    mean = sum(gains) / len(gains)
    print("\n".join(lines))
    print(f"\nsampled gain: mean {mean:+.1f} points, smallest {min(gains):+.1f} ({len(gains)} seeds)")
    if args.record:
        write_record(
            args.record,
            name=Path(args.record).stem,
            figure=f"{name} on seeds {', '.join(map(str, args.seeds))}: held-out sampled pass@1 gain, mean "
            f"{mean:+.1f} points (smallest {min(gains):+.1f})",
            unit="points",
            value=round(mean, 1),
            values={k: round(v, 1) for k, v in figures.items()} | {"smallest": round(min(gains), 1)},
        )


if __name__ == "__main__":
    main()
