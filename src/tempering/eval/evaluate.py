"""Held-out evaluation: sample n completions (or episodes) per task, execute them, report pass@k overall and
per domain."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from tempering.agent.episodes import sample_episodes
from tempering.envs import EnvContext
from tempering.eval.passk import pass_at_k
from tempering.inference.engine import Engine
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
    """Mean fraction of hidden tests passed by the final attempt (success, for non-code tasks)."""
    per_task: dict[str, int] = field(default_factory=dict)
    """Correct samples per task id."""

    def to_json(self) -> dict:
        return asdict(self)


def evaluate(
    engine: Engine,
    tasks: list[Task],
    ctx: EnvContext,
    *,
    samples: int = 1,
    ks: tuple[int, ...] = (1,),
    greedy: bool = False,
    max_context: int = 1024,
    seed: int = 0,
    chat: str = "auto",
) -> EvalReport:
    """pass@k of the final attempt for each k in `ks` (unbiased estimator over `samples` episodes per task;
    greedy forces samples=1), overall and per domain; with several turns also `first_turn_pass@1` and
    `turns/mean`. The sampling distribution is `engine.sampling`'s."""
    if greedy:
        samples = 1
    ks = tuple(k for k in ks if k <= samples) or (1,)
    # Sorting by prompt length keeps padding low in each generation chunk; the result does not depend on it.
    ordered = sorted(tasks, key=lambda t: len(t.prompt))
    episodes = sample_episodes(
        engine,
        ordered,
        ctx,
        group_size=samples,
        max_context=max_context,
        greedy=greedy,
        generator=torch.Generator().manual_seed(seed),
        seed=seed,
        chat=chat,
    )
    correct: dict[str, int] = defaultdict(int)
    first: dict[str, int] = defaultdict(int)
    passed = 0.0
    for e in episodes:
        correct[e.task.id] += int(e.success)
        first[e.task.id] += int(e.first_success)
        passed += float(e.success if e.turns[-1].passed is None else e.turns[-1].passed) if e.turns else 0.0
    by_domain: dict[str, list[Task]] = defaultdict(list)
    for task in ordered:
        by_domain[task.domain].append(task)

    def score(group: list[Task]) -> dict[str, float]:
        out = {f"pass@{k}": sum(pass_at_k(samples, correct[t.id], k) for t in group) / len(group) for k in ks}
        if ctx.max_turns > 1:
            out["first_turn_pass@1"] = sum(first[t.id] for t in group) / (samples * len(group))
        return out

    overall = score(ordered)
    if ctx.max_turns > 1:
        overall["turns/mean"] = sum(len(e.turns) for e in episodes) / max(1, len(episodes))
    return EvalReport(
        num_tasks=len(tasks),
        samples=samples,
        temperature=None if greedy else engine.sampling.temperature,
        overall=overall,
        per_domain={d: score(g) for d, g in sorted(by_domain.items())},
        domain_tasks={d: len(g) for d, g in sorted(by_domain.items())},
        mean_reward_tests=passed / max(1, len(episodes)),
        per_task={t.id: correct[t.id] for t in ordered},
    )


def validation_metrics(
    engine: Engine, tasks: list[Task], ctx: EnvContext, *, seed: int, max_context: int, chat: str = "auto"
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The loop's validation row: sampled pass@1 (2 per task), greedy pass@1, first-turn and per-domain;
    and {domain: each task's sampled pass@1} (what the domain monitor reads)."""
    kw = dict(max_context=max_context, chat=chat)
    sampled = evaluate(engine, tasks, ctx, samples=2, seed=seed, **kw)
    greedy = evaluate(engine, tasks, ctx, greedy=True, **kw)
    m = {"val/pass@1": sampled.overall["pass@1"], "val/greedy_pass@1": greedy.overall["pass@1"]}
    if "first_turn_pass@1" in sampled.overall:
        m["val/first_turn_pass@1"] = sampled.overall["first_turn_pass@1"]
    for domain, scores in sampled.per_domain.items():
        m[f"val/{domain}/pass@1"] = scores["pass@1"]
    per_task: dict[str, list[float]] = defaultdict(list)
    for task in tasks:
        per_task[task.domain].append(sampled.per_task[task.id] / sampled.samples)
    return m, dict(per_task)
