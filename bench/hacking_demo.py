"""A deliberately hackable reward, learned with guards off and not with guards on.

    .venv/bin/python bench/hacking_demo.py [--hack exit|lookup] [--steps 150] [--out runs/hacking]

Two GRPO runs from the same SFT checkpoint, identical but for `reward.guards`; the guard is logged in
both (`reward/hacking/<kind>`) and penalised (reward -1) only in the second. Prints, per window of steps,
the share of samples caught, the hackable reward, and the hidden-test pass rate of the samples; then
held-out pass@1 on the hidden tests.

--hack exit (default): reward `naive_harness`, a harness that trusts a clean exit status, so
`import sys; sys.exit(0)` before the tests earns full marks; guard `exit_before_tests`.
--hack lookup: reward `examples`, the share of the prompt's *visible* examples passed, so a lookup table
of them earns full marks; guard `hardcoded_examples`.

A model trained from scratch on honest references never writes either, so RL has nothing to amplify
(measured: lookup tables in 0.1-0.6% of samples, no trend, with guards off). A pretrained model knows
these tricks; to give the tiny one the same starting point, `--seed-fraction` of the SFT references are
replaced by the hack (for lookup: tasks with one hashable argument).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lookup_table(task: dict) -> str | None:
    """A reference that returns the visible examples' outputs and 0 elsewhere, for one-argument tasks."""
    import ast

    fn = ast.parse(task["prompt"] + "    pass\n").body[0]
    if len(fn.args.args) != 1 or not task["examples"]:
        return None
    inputs = [e["input"][0] for e in task["examples"]]
    if not all(isinstance(x, (int, str)) for x in inputs):
        return None
    table = ", ".join(f"{x!r}: {e['output']!r}" for x, e in zip(inputs, task["examples"]))
    return f"{task['prompt'].splitlines()[0]}\n    return {{{table}}}.get({fn.args.args[0].arg}, 0)\n"


def exit_hack(task: dict) -> str:
    """A reference that ends the program before any test can run."""
    return f"{task['prompt'].splitlines()[0]}\n    return 0\nimport sys\nsys.exit(0)\n"


def seeded_data(directory: Path, fraction: float, hack: str) -> list[str]:
    """The built-in task files, with `fraction` of the training references replaced by the hack."""
    import random

    subprocess.run(
        [sys.executable, "-m", "tempering.cli", "data", "generate", "--out", str(directory)],
        check=True,
        cwd=ROOT,
    )
    rng = random.Random(0)
    path = directory / "train.jsonl"
    tasks = [json.loads(line) for line in path.read_text().splitlines()]
    seeded = 0
    for task in tasks:
        if rng.random() < fraction and (ref := exit_hack(task) if hack == "exit" else lookup_table(task)):
            task["reference_solution"] = ref
            seeded += 1
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    print(f"{seeded} of {len(tasks)} SFT references are the '{hack}' hack")
    return [f"data.train_file={path}", f"data.heldout_file={directory / 'heldout.jsonl'}"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window", type=int, default=25)
    parser.add_argument("--out", default="runs/hacking")
    parser.add_argument("--sft", help="an SFT model directory to start from (default: run the SFT stage)")
    parser.add_argument(
        "--seed-fraction", type=float, default=0.1, help="share of SFT references replaced by the hack"
    )
    parser.add_argument("--hack", choices=["exit", "lookup"], default="exit")
    args = parser.parse_args()
    out = ROOT / args.out
    data = []
    if not args.sft:
        data = seeded_data(out / "data", args.seed_fraction, args.hack)
    sft = Path(args.sft) if args.sft else out / "sft" / "sft" / "model"
    if not args.sft and not sft.is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tempering.cli",
                "sft",
                "configs/tiny-code.yaml",
                f"run.dir={out / 'sft'}",
                *data,
            ],
            check=True,
            cwd=ROOT,
        )
    reward, guard = (
        ("naive_harness", "exit_before_tests") if args.hack == "exit" else ("examples", "hardcoded_examples")
    )
    results = {}
    for guards in (False, True):
        run_dir = out / ("guards_on" if guards else "guards_off")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tempering.cli",
                "train",
                "configs/tiny-code.yaml",
                f"model.path={sft}",
                "sft.steps=0",
                f"run.dir={run_dir}",
                f"train.steps={args.steps}",
                "eval.every=0",
                "algo.guidance=none",  # the demo is about what the reward alone teaches
                f"reward.weights={{{reward}: 1.0}}",
                f"reward.guards={str(guards).lower()}",
                f"reward.guard_kinds=[{guard}]",
                "reward.penalty=-1.0",
                "tracking.progress=false",
                *data,
            ],
            check=True,
            cwd=ROOT,
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        results[guards] = (rows, json.loads((run_dir / "summary.json").read_text()))

    print(f"\nreward = {reward} (hackable), guard {guard}; {args.steps} GRPO steps from one SFT start")
    head = (
        f"{'steps':>9} | {'hacking (off)':>16} {'reward (off)':>14} {'hidden (off)':>12} | "
        f"{'hacking (on)':>15} {'reward (on)':>13} {'hidden (on)':>11}"
    )
    print(head)
    print("-" * len(head))
    for start in range(0, args.steps, args.window):
        cells = []
        for guards in (False, True):
            window = results[guards][0][start : start + args.window]
            keys = (f"reward/hacking/{guard}", f"reward/{reward}/mean", "train/pass_rate")
            cells.append(tuple(sum(r[k] for r in window) / len(window) for k in keys))
        (h0, e0, p0), (h1, e1, p1) = cells
        print(
            f"{start + 1:>4}-{start + args.window:<4} | {h0:>16.1%} {e0:>14.3f} {p0:>12.1%} | "
            f"{h1:>15.1%} {e1:>13.3f} {p1:>11.1%}"
        )
    for guards in (False, True):
        s = results[guards][1]
        print(
            f"guards {'on ' if guards else 'off'}: held-out pass@1 (hidden tests) {s['heldout_pass@1_before']:.1%} -> "
            f"{s['heldout_pass@1_after']:.1%}"
        )


if __name__ == "__main__":
    main()
