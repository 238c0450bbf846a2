"""Per-phase RL step time of two source trees, in one run on one machine: is the new code slower?

    .venv/bin/python bench/phase_times.py --old REV [--steps 12] [--rounds 2]

For each recipe (the default `tiny-code.yaml` and `code-repair.yaml`) one SFT model is trained once
(`tempering sft`, shortened), then RL runs `--steps` steps from it with the old tree's code (a `git
worktree` of REV) and with this tree's, alternating `--rounds` times so that the machine's drift hits both
alike. Runs are deterministic, so both trees sample the same completions and do the same work. Printed:
the mean seconds per step of every `timing_s/*` phase (step 1 left out: warm-up), old vs new and the
ratio. `collect` is gen + reward: the old multi-turn path timed environment steps inside `gen`.

Both trees must do the same work. Where a recipe's meaning changed between them, NEW_OVERRIDES gives the new
tree the old one's reward (code-repair: the old multi-turn path ignored `reward.weights` and scored episodes
`tests + 0.2 improvement`, so `format` from the base recipe must not apply). `tokens` (trained response tokens
per episode) and `turns` are printed so that equal work can be checked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"tiny-code": "configs/tiny-code.yaml", "code-repair": "configs/code-repair.yaml"}
COMMON = ["data.num_train=3000", "data.num_heldout=64", "eval.samples=1", "eval.every=0", "checkpoint.every=100000", "tracking.progress=false",
          "tracking.tensorboard=false", "tracking.samples_every=0"]
NEW_OVERRIDES = {"code-repair": ["reward.weights={tests: 1.0, improvement: 0.2}"]}


def tempering(tree: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run([sys.executable, "-m", "tempering.cli", *args], check=True, cwd=tree, env=env,
                   stdout=subprocess.DEVNULL)


def phases(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    out: dict[str, float] = defaultdict(float)
    for row in rows:
        for key, value in row.items():
            if key.startswith("timing_s/") and key != "timing_s/checkpoint":
                out[key.removeprefix("timing_s/")] += value / len(rows)
            elif key in ("response_length/mean", "num_turns/mean"):
                out["tokens" if key.startswith("response") else "turns"] += value / len(rows)
    out["collect"] = out.get("gen", 0.0) + out.get("reward", 0.0)
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="git revision of the old code")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="phase-times-"))
    old_tree = work / "old"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old_tree), args.old], check=True, cwd=ROOT)
    try:
        for name in args.recipes:
            recipe = RECIPES[name]
            sft_dir = work / f"{name}-sft"
            tempering(ROOT, "sft", recipe, f"run.dir={sft_dir}", f"sft.steps={args.sft_steps}", *COMMON)
            model = sft_dir / "sft" / "model"
            totals: dict[str, dict[str, list[float]]] = {"old": defaultdict(list), "new": defaultdict(list)}
            for r in range(args.rounds):
                for arm, tree in (("old", old_tree), ("new", ROOT)):
                    run_dir = work / f"{name}-{arm}-{r}"
                    extra = NEW_OVERRIDES.get(name, []) if arm == "new" else []
                    tempering(tree, "train", recipe, f"run.dir={run_dir}", f"model.path={model}", "sft.steps=0",
                              f"train.steps={args.steps}", *COMMON, *extra)
                    for phase, seconds in phases(run_dir).items():
                        totals[arm][phase].append(seconds)
            print(f"\n{name}: mean s/step over steps 2-{args.steps}, {args.rounds} alternating rounds")
            print(f"{'phase':<10} {'old':>8} {'new':>8} {'new/old':>8}")
            for phase in sorted(set(totals["old"]) | set(totals["new"])):
                old = sum(totals["old"][phase]) / max(1, len(totals["old"][phase]))
                new = sum(totals["new"][phase]) / max(1, len(totals["new"][phase]))
                ratio = f"{new / old:.3f}" if old > 0 and totals["new"][phase] else "-"
                print(f"{phase:<10} {old:>8.3f} {new:>8.3f} {ratio:>8}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT)


if __name__ == "__main__":
    main()
