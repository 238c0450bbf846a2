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
            raise ValueError(f"sampler state is for {state['num_tasks']} tasks, this run has {len(self.tasks)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
