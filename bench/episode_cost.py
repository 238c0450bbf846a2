"""What an RL step costs with 1 and with 3 attempts per episode: rollout, update, tokens.

    .venv/bin/python bench/episode_cost.py [--model DIR] [--tasks FILE]

One GRPO-sized batch (16 built-in code tasks x 8 episodes) from the same model: the rollout (generation
turns + sandbox feedback) and one policy update (2 minibatches) are timed, and the batch's policy tokens
and attended tokens (policy + observations) counted. Default model: the SFT checkpoint that
bench/multiturn_compare.py writes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from tempering.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AdvantageInputs
from tempering.data import generate_tasks, load_tasks
from tempering.envs import EnvContext
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.models.loading import load_model, load_tokenizer
from tempering.rewards import RewardFunction
from tempering.rollout.batch import collate
from tempering.rollout.episodes import run_episodes
from tempering.sandbox import LocalSandbox
from tempering.training.optim import make_optimizer
from tempering.training.update import UpdateSettings, update_policy

ROOT = Path(__file__).resolve().parent.parent


class TimedEngine(LocalEngine):
    """The in-process engine, noting each generation call: rows x longest context -> seconds."""

    calls: list[str]

    def generate(self, contexts, **kw):
        self.calls = getattr(self, "calls", [])
        start = time.perf_counter()
        gen = super().generate(contexts, **kw)
        self.calls.append(
            f"{len(contexts)}x{max(len(c) for c in contexts)}->{time.perf_counter() - start:.2f}"
        )
        return gen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / "runs/multiturn_compare/sft/sft/model"))
    parser.add_argument("--tasks", help="JSONL task file (default: built-in training tasks)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    tasks = load_tasks(args.tasks) if args.tasks else generate_tasks(2000, 16, seed=1234)[0]
    tasks = tasks[100:116]
    print(
        f"{'attempts':>8} {'rollout s':>9} {'generation calls (rows x context -> s)':<44} {'update s':>8} "
        f"{'policy tok':>10} {'attended':>8}"
    )
    with LocalSandbox(workers=2) as sandbox:
        for turns in (1, 3):
            engine = TimedEngine(model, tokenizer, SamplingParams(max_new_tokens=48))
            ctx = EnvContext(sandbox, max_turns=turns, feedback_chars=200)
            start = time.perf_counter()
            episodes = run_episodes(
                engine, tasks, ctx, group_size=8, max_context=512, generator=torch.Generator().manual_seed(0)
            )
            rollout_s = time.perf_counter() - start
            batch = collate(episodes, RewardFunction().score(episodes), tokenizer)
            inputs = AdvantageInputs(batch.rewards, batch.response_mask, batch.group_ids)
            batch.advantages, batch.returns = ADVANTAGE_ESTIMATORS["grpo"](inputs)
            optimizer = make_optimizer(model, lr=0.0)  # lr 0: timing only, the model stays as it is
            start = time.perf_counter()
            update_policy(
                model,
                optimizer,
                batch.informative(),
                POLICY_LOSSES["ppo_clip"],
                UpdateSettings(minibatches=2),
                torch.Generator().manual_seed(0),
            )
            update_s = time.perf_counter() - start
            print(
                f"{turns:>8} {rollout_s:>9.2f} {', '.join(engine.calls):<44} {update_s:>8.2f} "
                f"{int(batch.response_mask.sum()):>10} {int(batch.attention.sum()):>8}"
            )


if __name__ == "__main__":
    main()
