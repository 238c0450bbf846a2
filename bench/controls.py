"""A recipe's gain beside its controls: the same recipe at equal compute with the reward replaced by a coin
flip of the same mean (`reward.control: coin`) and with the format reward alone; a gain counts by how much
it exceeds the controls'.

    .venv/bin/python bench/controls.py CONFIG [--seeds 0 1 2] [--arms real coin format] [--same-steps]
                                       [--out runs/controls-NAME] [--record results/controls-NAME.json]

For each seed the SFT stage (if the recipe has one) runs once and every arm starts RL from its model
(`model.path`, `sft.steps=0`), so the arms differ in their reward only: same steps budget
(`train.max_time_s`, `train.steps`; with --same-steps the controls run exactly the real arm's RL steps), same
held-out tasks and evaluation. A finished arm is reused (delete its directory to redo it). Printed per seed and arm: held-out sampled pass@1 before and after RL, the gain with
its paired 95% interval, greedy, and each named benchmark's greedy pass@1; then the real arm's excess over
each control - the mean over held-out tasks of (real after - control after), both arms starting from the
same model and evaluation before, with its paired bootstrap interval over tasks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from algo_compare import reuse_eval_before
from record import write_record

from tempering.config import load_config
from tempering.eval.intervals import format_gain, paired_gain

ROOT = Path(__file__).resolve().parent.parent
ARMS = {
    "real": [],
    "coin": ["reward.control=coin"],
    "format": ["reward.weights={format: 1.0}", "reward.params={}"],
}
"""Each arm's overrides of the recipe."""


def tempering(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tempering.cli", *map(str, args)], check=True, cwd=ROOT)


def start_model(config: str, seed: int, out: Path) -> list[str]:
    """The overrides that start every arm of a seed from the same model: the recipe's SFT model, run once."""
    if load_config(ROOT / config).sft.steps <= 0:
        return []
    sft = out / f"sft-s{seed}"
    if not (sft / "sft" / "DONE.json").is_file():
        tempering("sft", config, f"run.dir={sft}", f"run.seed={seed}")
    return [f"model.path={sft / 'sft' / 'model'}", "sft.steps=0"]


def run_arm(config: str, arm: str, seed: int, out: Path, start: list[str], steps: list[str]) -> Path:
    run_dir = out / f"{arm}-s{seed}"
    if not (run_dir / "summary.json").is_file():
        reuse_eval_before(run_dir, out, seed)
        tempering(
            "train", config, f"run.dir={run_dir}", f"run.seed={seed}", *start, *ARMS[arm], *steps,
            "tracking.progress=false",
        )  # fmt: skip
    return run_dir


def same_steps(real: Path) -> list[str]:
    """The controls' budget under --same-steps: the real arm's RL steps, whatever the clock says (a recipe
    bounded by `train.max_time_s` runs fewer steps on a slower hour)."""
    steps = json.loads((real / "summary.json").read_text())["rl_steps"]
    return [f"train.steps={steps}", "train.max_time_s=null"]


def per_task(run_dir: Path, name: str, kind: str = "sampled") -> dict[str, float]:
    e = json.loads((run_dir / f"{name}.json").read_text())[kind]
    return {t: c / e["samples"] for t, c in e["per_task"].items()}


def excess(real: Path, control: Path, name: str, kind: str) -> list[float]:
    """[mean, low, high] of real-after minus control-after over the same tasks."""
    a, b = per_task(real, name, kind), per_task(control, name, kind)
    ids = sorted(set(a) & set(b))
    return paired_gain([b[t] for t in ids], [a[t] for t in ids])


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table(runs: dict[tuple[str, int], Path]) -> tuple[str, dict[str, float]]:
    lines = [
        "| seed | arm | steps | sampled before | sampled after | gain [95% CI] | greedy before -> after | benchmarks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (arm, seed), run_dir in runs.items():
        s = json.loads((run_dir / "summary.json").read_text())
        gain = s.get("intervals", {}).get("sampled", {}).get("all", {}).get("gain")
        marks = ", ".join(
            f"{n} {pct(b['greedy_pass@1_before'])} -> {pct(b['greedy_pass@1_after'])}"
            for n, b in s.get("benchmarks", {}).items()
        )
        lines.append(
            f"| {seed} | {arm} | {s['rl_steps']} | {pct(s['heldout_pass@1_before'])} | "
            f"{pct(s['heldout_pass@1_after'])} | {format_gain(gain)} | "
            f"{pct(s['heldout_greedy_pass@1_before'])} -> {pct(s['heldout_greedy_pass@1_after'])} | {marks} |"
        )
    figures: dict[str, float] = {}
    lines += [
        "",
        "| seed | real over | sampled excess [95% CI] | greedy excess [95% CI] |",
        "|---|---|---|---|",
    ]
    for (arm, seed), run_dir in runs.items():
        if arm == "real" or ("real", seed) not in runs:
            continue
        real = runs[("real", seed)]
        sampled, greedy = (excess(real, run_dir, "eval_after", k) for k in ("sampled", "greedy"))
        lines.append(f"| {seed} | {arm} | {format_gain(sampled)} | {format_gain(greedy)} |")
        figures |= {f"excess_over_{arm}_s{seed}": sampled[0], f"excess_over_{arm}_s{seed}_low": sampled[1]}
    return "\n".join(lines) + "\n", figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--out", help="default runs/controls-<config name>")
    parser.add_argument("--record", metavar="PATH", help="also write the excess gains as a result record")
    parser.add_argument(
        "--same-steps",
        action="store_true",
        help="the controls run the real arm's RL steps (not the recipe's train.max_time_s)",
    )
    args = parser.parse_args()
    name = Path(args.config).stem
    out = ROOT / (args.out or f"runs/controls-{name}")
    runs = {}
    for seed in args.seeds:
        start = start_model(args.config, seed, out)
        steps: list[str] = []
        for arm in sorted(args.arms, key=lambda a: a != "real"):  # the real arm first
            runs[(arm, seed)] = run_arm(args.config, arm, seed, out, start, steps)
            if arm == "real" and args.same_steps:
                steps = same_steps(runs[(arm, seed)])
    text, figures = table(runs)
    print(text)
    if args.record and figures:
        lows = [v for k, v in figures.items() if k.endswith("_low")]
        write_record(
            args.record,
            name=Path(args.record).stem,
            figure=f"{name}: the real reward's held-out gain in excess of the coin-flip and format-only controls' "
            "(lowest lower bound of the paired 95% intervals)",
            unit="points",
            value=round(100 * min(lows), 1),
            values={k: round(100 * v, 1) for k, v in figures.items()},
        )


if __name__ == "__main__":
    main()
