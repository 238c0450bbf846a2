"""Every algorithm on the default task with the same wall-clock budget, from the same SFT checkpoint.

    .venv/bin/python bench/algos_compare.py [--budget-s 180] [--out runs/algos_compare] [--sft DIR]

Runs the SFT stage of configs/tiny-code.yaml once (or reuses --sft, a model directory), then for each
recipe in configs/algos/ runs RL for --budget-s seconds of wall clock (train.max_time_s) and evaluates on
the 512 held-out tasks. Prints a table of held-out pass@1 (sampled at T=1, 4 samples; greedy), steps done
and mean training reward over the last 20 steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ALGOS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo_gae", "dapo"]
ROOT = Path(__file__).resolve().parent.parent


def tempering(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tempering.cli", *args], check=True, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=180.0, help="RL wall-clock budget per algorithm")
    parser.add_argument("--out", default="runs/algos_compare")
    parser.add_argument("--sft", help="an SFT model directory to start from (default: run the SFT stage)")
    parser.add_argument("--algos", nargs="+", default=ALGOS)
    args = parser.parse_args()
    out = ROOT / args.out
    sft = Path(args.sft) if args.sft else out / "sft" / "sft" / "model"
    if not args.sft and not sft.is_dir():
        tempering("sft", "configs/tiny-code.yaml", f"run.dir={out / 'sft'}")
    rows = []
    for algo in args.algos:
        run_dir = out / algo
        began = time.monotonic()
        tempering("train", f"configs/algos/{algo}.yaml", f"model.path={sft}", "sft.steps=0", f"run.dir={run_dir}",
                  "train.steps=100000", f"train.max_time_s={args.budget_s}", "eval.every=0",
                  "checkpoint.every=100000", "tracking.progress=false")
        summary = json.loads((run_dir / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        tail = [m["reward/mean"] for m in metrics[-20:] if "reward/mean" in m]
        rows.append((algo, summary, len(metrics), sum(tail) / max(1, len(tail)), time.monotonic() - began))

    print(f"\nheld-out pass@1 (512 tasks never trained on), RL budget {args.budget_s:.0f} s each, same SFT start")
    head = f"{'algorithm':<14} {'steps':>5} {'reward(last20)':>14} {'sampled before':>14} {'sampled after':>13} " \
           f"{'greedy before':>13} {'greedy after':>12}"
    print(head)
    print("-" * len(head))
    for algo, s, steps, reward, _ in rows:
        print(f"{algo:<14} {steps:>5} {reward:>14.3f} {s['heldout_pass@1_before']:>14.1%} "
              f"{s['heldout_pass@1_after']:>13.1%} {s['heldout_greedy_pass@1_before']:>13.1%} "
              f"{s['heldout_greedy_pass@1_after']:>12.1%}")


if __name__ == "__main__":
    main()
