"""Held-out evaluation: sample n completions (or episodes) per task, execute them, report pass@k overall and
per domain."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from tempering.envs import EnvContext
from tempering.eval.passk import pass_at_k
from tempering.rollout.code import rollout
from tempering.rollout.episodes import run_episodes
from tempering.sandbox import Sandbox
from tempering.types import Task


@dataclass
class EvalReport:
    num_tasks: int
    samples: int
    temperature: float | None
    """None for greedy decoding."""
    overall: dict[str, float]
    per_domain: dict[str, dict[str, float]]
    domain_tasks: dict[str, int]
    mean_reward_tests: float = 0.0
    """Mean fraction of hidden tests passed per sample."""
    per_task: dict[str, int] = field(default_factory=dict)
    """Correct samples per task id."""

    def to_json(self) -> dict:
        return asdict(self)


def evaluate(
    model,
    tokenizer,
    tasks: list[Task],
    sandbox: Sandbox,
    *,
    samples: int = 1,
    ks: tuple[int, ...] = (1,),
    temperature: float = 1.0,
    greedy: bool = False,
    max_new_tokens: int = 48,
    seed: int = 0,
) -> EvalReport:
    """pass@k for each k in `ks` (unbiased estimator over `samples` per task); greedy forces samples=1."""
    if greedy:
        samples = 1
    ks = tuple(k for k in ks if k <= samples) or (1,)
    # Sorting by prompt length keeps padding low in each generation chunk; the result does not depend on it.
    ordered = sorted(tasks, key=lambda t: len(t.prompt))
    generator = torch.Generator().manual_seed(seed)
    trajectories, _ = rollout(model, tokenizer, ordered, sandbox, group_size=samples, max_new_tokens=max_new_tokens,
                              temperature=temperature, greedy=greedy, generator=generator)
    correct: dict[str, int] = defaultdict(int)
    frac = 0.0
    for traj in trajectories:
        correct[traj.task.id] += int(traj.exec_result.all_passed)
        frac += traj.exec_result.passed_fraction
    by_domain: dict[str, list[Task]] = defaultdict(list)
    for task in ordered:
        by_domain[task.domain].append(task)

    def score(group: list[Task]) -> dict[str, float]:
        return {f"pass@{k}": sum(pass_at_k(samples, correct[t.id], k) for t in group) / len(group) for k in ks}

    return EvalReport(
        num_tasks=len(tasks),
        samples=samples,
        temperature=None if greedy else temperature,
        overall=score(ordered),
        per_domain={d: score(g) for d, g in sorted(by_domain.items())},
        domain_tasks={d: len(g) for d, g in sorted(by_domain.items())},
        mean_reward_tests=frac / max(1, len(trajectories)),
        per_task={t.id: correct[t.id] for t in ordered},
    )


def evaluate_episodes(
    model,
    tokenizer,
    tasks: list[Task],
    ctx: EnvContext,
    *,
    samples: int = 1,
    temperature: float = 1.0,
    greedy: bool = False,
    max_new_tokens: int = 48,
    max_context: int = 1024,
    seed: int = 0,
    chat: str = "auto",
) -> EvalReport:
    """Episode success rate (pass@1 of the final attempt) and first-turn pass@1, overall and per domain,
    with up to `ctx.max_turns` turns per episode."""
    if greedy:
        samples = 1
    ordered = sorted(tasks, key=lambda t: len(t.prompt))
    generator = torch.Generator().manual_seed(seed)
    episodes = run_episodes(model, tokenizer, ordered, ctx, group_size=samples, max_new_tokens=max_new_tokens,
                            max_context=max_context, temperature=temperature, greedy=greedy, generator=generator,
                            seed=seed, chat=chat)
    correct: dict[str, int] = defaultdict(int)
    first: dict[str, int] = defaultdict(int)
    for e in episodes:
        correct[e.task.id] += int(e.success)
        first[e.task.id] += int(e.first_success)
    by_domain: dict[str, list[Task]] = defaultdict(list)
    for task in ordered:
        by_domain[task.domain].append(task)

    def score(group: list[Task]) -> dict[str, float]:
        return {"pass@1": sum(correct[t.id] for t in group) / (samples * len(group)),
                "first_turn_pass@1": sum(first[t.id] for t in group) / (samples * len(group))}

    return EvalReport(
        num_tasks=len(tasks), samples=samples, temperature=None if greedy else temperature,
        overall={**score(ordered), "turns/mean": sum(len(e.turns) for e in episodes) / max(1, len(episodes))},
        per_domain={d: score(g) for d, g in sorted(by_domain.items())},
        domain_tasks={d: len(g) for d, g in sorted(by_domain.items())},
        mean_reward_tests=sum(e.success for e in episodes) / max(1, len(episodes)),
        per_task={t.id: correct[t.id] for t in ordered},
    )
