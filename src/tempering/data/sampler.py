"""Resumable task sampling: epochs of seeded permutations; the position is part of every checkpoint."""

from __future__ import annotations

import random
from typing import Any

from tempering.types import Task


class TaskSampler:
    """Draws batches without replacement within an epoch; `state_dict` / `load_state_dict` resume exactly."""

    def __init__(self, tasks: list[Task], seed: int):
        if not tasks:
            raise ValueError("no tasks to sample from")
        self.tasks = tasks
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Task]:
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            batch.append(self.tasks[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_tasks": len(self.tasks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_tasks", len(self.tasks)) != len(self.tasks):
            raise ValueError(
                f"sampler state is for {state['num_tasks']} tasks, this run has {len(self.tasks)}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


class MixtureSampler:
    """Draws each task's domain by weight, then a task of that domain (without replacement within the
    domain's epoch). The k-th draw's domain depends only on (seed, k), so the domain sequence is a pure
    function of the draw count; that count and every domain's position are the checkpointed state, and
    a resumed run continues the same sequence.

    `weights` maps domains to weights; the key `*` gives every unlisted domain that weight (default 0:
    unlisted domains are not drawn). `weights` (the attribute, {domain: weight}) may change during a run
    (the domain monitor, `eval/monitor.py`); it is part of the state, `base` keeps the configured ones."""

    def __init__(self, tasks: list[Task], weights: dict[str, float], seed: int):
        by_domain: dict[str, list[Task]] = {}
        for task in tasks:
            by_domain.setdefault(task.domain, []).append(task)
        unknown = set(weights) - set(by_domain) - {"*"}
        if unknown:
            raise ValueError(f"data.mixture names domain(s) without tasks: {sorted(unknown)}")
        default = weights.get("*", 0.0)
        self.domains = sorted(d for d in by_domain if weights.get(d, default) > 0)
        if not self.domains:
            raise ValueError("data.mixture gives no domain a positive weight")
        self.base = {d: float(weights.get(d, default)) for d in self.domains}
        self.weights = dict(self.base)
        self.samplers = {d: TaskSampler(by_domain[d], seed=seed) for d in self.domains}
        self.seed, self.draws = seed, 0

    def next_batch(self, n: int) -> list[Task]:
        batch = []
        for _ in range(n):
            weights = [self.weights[d] for d in self.domains]
            domain = random.Random(f"mixture:{self.seed}:{self.draws}").choices(self.domains, weights)[0]
            self.draws += 1
            batch.append(self.samplers[domain].next_batch(1)[0])
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "domains": {d: s.state_dict() for d, s in self.samplers.items()},
            "weights": dict(self.weights),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state.get("domains", {})) != self.domains:
            raise ValueError(
                f"sampler state is for domains {sorted(state.get('domains', {}))}, "
                f"this run mixes {self.domains}"
            )
        self.draws = int(state["draws"])
        self.weights = {d: float(w) for d, w in state.get("weights", self.base).items()}
        for d, s in state["domains"].items():
            self.samplers[d].load_state_dict(s)
