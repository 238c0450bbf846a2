"""Single-turn code rollouts: sample `group_size` completions per task, execute each against its tests."""

from __future__ import annotations

import torch

from tempering.rollout.generate import Generation, encode_prompt, generate
from tempering.sandbox import Sandbox
from tempering.types import Task, Trajectory


def execute(trajectories: list[Trajectory], sandbox: Sandbox) -> None:
    """Fill `exec_result` of every trajectory. Identical programs for the same task run once."""
    unique: dict[tuple[str, str], list[Trajectory]] = {}
    for traj in trajectories:
        unique.setdefault((traj.task.id, traj.program), []).append(traj)
    groups = list(unique.values())
    results = sandbox.run_tests_batch([(g[0].task, g[0].program) for g in groups])
    for group, result in zip(groups, results):
        for traj in group:
            traj.exec_result = result


def sample(
    model,
    tokenizer,
    tasks: list[Task],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[list[Trajectory], Generation]:
    """`group_size` completions per task (consecutive rows), not yet executed."""
    prompts = [encode_prompt(tokenizer, task.prompt) for task in tasks for _ in range(group_size)]
    gen = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, greedy=greedy, generator=generator)
    trajectories = [
        Trajectory(task=tasks[i // group_size], group_id=i // group_size, completion=text, truncated=bool(trunc))
        for i, (text, trunc) in enumerate(zip(gen.texts, gen.truncated))
    ]
    return trajectories, gen


def rollout(model, tokenizer, tasks: list[Task], sandbox: Sandbox, **sampling) -> tuple[list[Trajectory], Generation]:
    """Sample and execute: the trajectories carry their ExecResult."""
    trajectories, gen = sample(model, tokenizer, tasks, **sampling)
    execute(trajectories, sandbox)
    return trajectories, gen
