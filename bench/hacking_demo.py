"""A deliberately hackable reward, learned with guards off and not with guards on.

    .venv/bin/python bench/hacking_demo.py [--steps 150] [--sft DIR] [--out runs/hacking]

The reward is `examples`: the fraction of the examples *shown in the prompt* that the program passes - a
lookup table of the visible cases earns all of it. Two GRPO runs from the same SFT checkpoint, identical
but for `reward.guards`; the `hardcoded_examples` guard is logged in both (`reward/hacking/...`) and
penalised (reward -1) only in the second. Prints, per window of steps, the share of samples caught
hard-coding, the examples reward, and the hidden-test pass rate of the samples; then held-out pass@1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--out", default="runs/hacking")
    parser.add_argument("--sft", help="an SFT model directory to start from (default: run the SFT stage)")
    args = parser.parse_args()
    out = ROOT / args.out
    sft = Path(args.sft) if args.sft else out / "sft" / "sft" / "model"
    if not args.sft and not sft.is_dir():
        subprocess.run([sys.executable, "-m", "tempering.cli", "sft", "configs/tiny-code.yaml",
                        f"run.dir={out / 'sft'}"], check=True, cwd=ROOT)
    results = {}
    for guards in (False, True):
        run_dir = out / ("guards_on" if guards else "guards_off")
        subprocess.run([sys.executable, "-m", "tempering.cli", "train", "configs/tiny-code.yaml", f"model.path={sft}",
                        "sft.steps=0", f"run.dir={run_dir}", f"train.steps={args.steps}", "eval.every=0",
                        "reward.weights={examples: 1.0}", f"reward.guards={str(guards).lower()}",
                        "reward.guard_kinds=[hardcoded_examples]", "reward.penalty=-1.0", "tracking.progress=false"],
                       check=True, cwd=ROOT)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results[guards] = (rows, json.loads((run_dir / "summary.json").read_text()))

    print(f"\nreward = fraction of the prompt's visible examples passed; {args.steps} GRPO steps from one SFT start")
    head = f"{'steps':>9} | {'hard-coded (off)':>16} {'examples (off)':>14} {'hidden (off)':>12} | " \
           f"{'hard-coded (on)':>15} {'examples (on)':>13} {'hidden (on)':>11}"
    print(head)
    print("-" * len(head))
    for start in range(0, args.steps, args.window):
        cells = []
        for guards in (False, True):
            window = results[guards][0][start: start + args.window]
            keys = ("reward/hacking/hardcoded_examples", "reward/examples/mean", "train/pass_rate")
            cells.append(tuple(sum(r[k] for r in window) / len(window) for k in keys))
        (h0, e0, p0), (h1, e1, p1) = cells
        print(f"{start + 1:>4}-{start + args.window:<4} | {h0:>16.1%} {e0:>14.3f} {p0:>12.1%} | "
              f"{h1:>15.1%} {e1:>13.3f} {p1:>11.1%}")
    for guards in (False, True):
        s = results[guards][1]
        print(f"guards {'on ' if guards else 'off'}: held-out pass@1 (hidden tests) {s['heldout_pass@1_before']:.1%} -> "
              f"{s['heldout_pass@1_after']:.1%}")


if __name__ == "__main__":
    main()
