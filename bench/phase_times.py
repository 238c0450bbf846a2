"""Per-phase RL step time of two source trees, in one run on one machine: is the new code slower?

    .venv/bin/python bench/phase_times.py --old REV [--steps 12] [--rounds 2]

For each recipe (by default `tiny-code.yaml` and `code-repair.yaml`; `--recipes smollm2-code` for the real
model, which starts from its instruct model without SFT) one SFT model is trained once (`tempering sft`,
shortened), then RL runs `--steps` steps from it with the old tree's code (a `git worktree` of REV) and
with this tree's, alternating `--rounds` times so that the machine's drift hits both alike. Printed: the
mean seconds per step of every `timing_s/*` phase (step 1 left out: warm-up), old vs new and the ratio,
and each run's peak resident memory (`peak GB`, the whole process). `collect` is gen + reward: the old
multi-turn path timed environment steps inside `gen`. Runs are deterministic within a tree; trees whose
samplers draw differently (the engine's per-row random streams, since December 2026) sample other
completions from the same model, so `tokens` and `turns` show how equal the work was.

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

from record import write_record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "tiny-code": "configs/tiny-code.yaml",
    "code-repair": "configs/code-repair.yaml",
    "smollm2-code": "configs/smollm2-code.yaml",
}
COMMON = [
    "eval.samples=1",
    "eval.every=0",
    "checkpoint.every=100000",
    "tracking.progress=false",
    "tracking.tensorboard=false",
    "tracking.samples_every=0",
    "train.max_time_s=null",
]
DATA = {
    "tiny-code": ["data.num_train=3000", "data.num_heldout=64"],
    "code-repair": ["data.num_train=3000", "data.num_heldout=64"],
    "smollm2-code": ["data.num_heldout=4", "algo.skip_zero_advantage=false"],
}
"""Per recipe: fewer held-out tasks than the recipe's own (the evaluations are not what is measured); the real
model trains every row, so that the update's work does not depend on which groups happened to carry signal."""
NO_SFT = {"smollm2-code"}
"""Recipes that start RL from their (instruct) model, without an SFT stage."""
NEW_OVERRIDES = {"code-repair": ["reward.weights={tests: 1.0, improvement: 0.2}"]}


def tempering(tree: Path, *args: str) -> float:
    """Run `tempering ARGS` with `tree`'s code; the process's peak resident memory in GB."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tempering.cli", *args], cwd=tree, env=env, stdout=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"tempering {' '.join(args)} failed ({proc.returncode})")
    return usage.ru_maxrss / 2**20


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old", required=True, help="git revision of the old code")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--recipes", nargs="+", default=["tiny-code", "code-repair"], choices=list(RECIPES))
    parser.add_argument(
        "--record",
        metavar="PATH",
        help="also write the first recipe's step time (new code) as a result record",
    )
    args = parser.parse_args()
    steps: dict[str, tuple[float, float]] = {}
    work = Path(tempfile.mkdtemp(prefix="phase-times-"))
    old_tree = work / "old"
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-q", str(old_tree), args.old], check=True, cwd=ROOT
    )
    try:
        for name in args.recipes:
            recipe, common = RECIPES[name], [*COMMON, *DATA[name]]
            start = []
            if name not in NO_SFT:
                sft_dir = work / f"{name}-sft"
                tempering(ROOT, "sft", recipe, f"run.dir={sft_dir}", f"sft.steps={args.sft_steps}", *common)
                start = [f"model.path={sft_dir / 'sft' / 'model'}", "sft.steps=0"]
            totals: dict[str, dict[str, list[float]]] = {"old": defaultdict(list), "new": defaultdict(list)}
            for r in range(args.rounds):
                for arm, tree in (("old", old_tree), ("new", ROOT)):
                    run_dir = work / f"{name}-{arm}-{r}"
                    extra = NEW_OVERRIDES.get(name, []) if arm == "new" else []
                    peak = tempering(
                        tree,
                        "train",
                        recipe,
                        f"run.dir={run_dir}",
                        *start,
                        f"train.steps={args.steps}",
                        *common,
                        *extra,
                    )
                    totals[arm]["peak GB"].append(peak)
                    for phase, seconds in phases(run_dir).items():
                        totals[arm][phase].append(seconds)
            print(
                f"\n{name}: mean s/step over steps 2-{args.steps}, {args.rounds} alternating rounds; peak GB: the "
                "whole run's resident memory"
            )
            print(f"{'phase':<10} {'old':>8} {'new':>8} {'new/old':>8}")
            for phase in sorted(set(totals["old"]) | set(totals["new"])):
                old = sum(totals["old"][phase]) / max(1, len(totals["old"][phase]))
                new = sum(totals["new"][phase]) / max(1, len(totals["new"][phase]))
                ratio = f"{new / old:.3f}" if old > 0 and totals["new"][phase] else "-"
                print(f"{phase:<10} {old:>8.3f} {new:>8.3f} {ratio:>8}")
                if phase == "step":
                    steps[name] = (old, new)
        if args.record and args.recipes[0] in steps:
            name = args.recipes[0]
            old, new = steps[name]
            write_record(
                args.record,
                name=f"step-time-{name}",
                figure=f"RL step of `{name}`: {new:.1f} s ({new / old:.2f}x the {old:.1f} s of {args.old})",
                unit="s",
                value=round(new, 3),
                values={"old": round(old, 3), "new": round(new, 3), "new/old": round(new / old, 3)},
                notes=f"Mean of steps 2-{args.steps}, {args.rounds} alternating rounds of old and new code.",
            )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT)


if __name__ == "__main__":
    main()
