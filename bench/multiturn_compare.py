"""Multi-turn code repair (up to 3 attempts with feedback) against single-turn RL, same wall-clock budget.

    .venv/bin/python bench/multiturn_compare.py [--budget-s 300] [--out runs/multiturn_compare] [--sft DIR]

Runs the SFT stage of configs/code-repair.yaml once (or reuses --sft), then RL from it twice for
--budget-s seconds each: single-turn (env.max_turns=1) and multi-turn (env.max_turns=3), both through the
environment driver with the same reward (hidden tests of the final attempt). Then evaluates the SFT start
and both final models on the 512 held-out tasks under both protocols - one attempt, and up to three with
feedback - sampled at T=1, 2 samples per task. Prints the table and writes OUT/compare.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/code-repair.yaml"


def tempering(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tempering.cli", *args], check=True, cwd=ROOT)


def cross_eval(models: dict[str, Path], heldout: Path, samples: int) -> dict[str, dict[str, dict]]:
    import torch

    from tempering.config import load_config
    from tempering.data import load_tasks
    from tempering.envs import EnvContext
    from tempering.eval.evaluate import evaluate
    from tempering.inference.engine import SamplingParams, make_engine
    from tempering.models.loading import load_model, load_tokenizer
    from tempering.workspace import make_sandbox

    cfg = load_config(ROOT / CONFIG)
    torch.set_num_threads(cfg.run.threads)
    tasks = load_tasks(heldout)
    out: dict[str, dict[str, dict]] = {}
    with make_sandbox(cfg) as sandbox:
        for name, path in models.items():
            engine = make_engine(
                load_model(path), load_tokenizer(path), SamplingParams(1.0, 1.0, cfg.rollout.max_new_tokens)
            )
            out[name] = {}
            for turns in (1, 3):
                ctx = EnvContext(sandbox, max_turns=turns, feedback_chars=cfg.env.feedback_chars)
                report = evaluate(
                    engine, tasks, ctx, samples=samples, max_context=cfg.env.max_context, seed=11
                )
                out[name][f"{turns}_attempts"] = report.overall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-s", type=float, default=300.0, help="RL wall-clock budget per arm")
    parser.add_argument("--out", default="runs/multiturn_compare")
    parser.add_argument("--sft", help="an SFT model directory to start from (default: run the SFT stage)")
    parser.add_argument("--samples", type=int, default=2, help="samples per held-out task in the final table")
    args = parser.parse_args()
    out = ROOT / args.out
    sft = Path(args.sft) if args.sft else out / "sft" / "sft" / "model"
    if not args.sft and not sft.is_dir():
        tempering("sft", CONFIG, f"run.dir={out / 'sft'}")
    arms = {"single-turn": 1, "multi-turn": 3}
    steps = {}
    for arm, turns in arms.items():
        run_dir = out / arm
        began = time.monotonic()
        tempering(
            "train",
            CONFIG,
            f"model.path={sft}",
            "sft.steps=0",
            f"run.dir={run_dir}",
            f"env.max_turns={turns}",
            "train.steps=100000",
            f"train.max_time_s={args.budget_s}",
            "eval.every=0",
            "checkpoint.every=100000",
            "tracking.progress=false",
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps[arm] = (len(rows), time.monotonic() - began)
    finals = {"SFT start": sft}
    for arm in arms:
        latest = (out / arm / "checkpoints" / "LATEST").read_text().strip()
        finals[arm] = out / arm / "checkpoints" / latest / "model"
    table = cross_eval(finals, out / "multi-turn" / "data" / "heldout.jsonl", args.samples)
    (out / "compare.json").write_text(
        json.dumps({"budget_s": args.budget_s, "steps": steps, "eval": table}, indent=1)
    )

    print(
        f"\nheld-out (512 tasks never trained on), T=1, {args.samples} samples per task; "
        f"RL budget {args.budget_s:.0f} s per arm from the same SFT checkpoint"
    )
    head = (
        f"{'model':<12} {'RL steps':>8} {'1 attempt':>10} {'3 attempts: first':>18} {'final':>7} {'turns':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, evals in table.items():
        n = steps.get(name, (0, 0))[0]
        one, three = evals["1_attempts"], evals["3_attempts"]
        print(
            f"{name:<12} {n:>8} {one['pass@1']:>10.1%} {three['first_turn_pass@1']:>18.1%} "
            f"{three['pass@1']:>7.1%} {three['turns/mean']:>6.2f}"
        )


if __name__ == "__main__":
    main()
