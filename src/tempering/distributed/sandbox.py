"""Sandbox actors (`distributed.sandbox_actors: n`): a pool of n Ray actors, each a `LocalSandbox`, shared by
the rollout workers through `RaySandbox` - the sandbox interface, with a batch's requests split over the
actors. An actor that dies (Ray restarts it) has its part of the batch re-sent to the next actor; executions
are pure (a fresh fork each, PYTHONHASHSEED=0), so the results are the ones it would have given, and no
request is ever reported as a sandbox error because an actor died."""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from tempering.sandbox import Sandbox, SandboxLimits
from tempering.sandbox.execution import ExecRequest

DIED = (RayActorError, ActorUnavailableError)


@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)
class SandboxActor:
    """One `LocalSandbox` (its warm workers) serving the rollout workers; `pid` answers while it executes."""

    def __init__(self, cfg_yaml: str):
        import yaml

        from tempering.config import RunConfig
        from tempering.workspace import make_sandbox

        self.sandbox = make_sandbox(RunConfig.model_validate(yaml.safe_load(cfg_yaml)))

    def execute_many(self, requests: list[ExecRequest], concurrency: int | None) -> list[dict[str, Any]]:
        return self.sandbox.execute_many(requests, concurrency=concurrency)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.sandbox.close()


class RaySandbox(Sandbox):
    def __init__(self, actors: list, limits: SandboxLimits, max_retries: int = 3):
        self.actors, self.limits, self.max_retries = list(actors), limits, max_retries
        self.retries = 0
        """Parts of batches re-sent because their actor died (the pool reports them as `dist/sandbox_retries`)."""

    def execute_many(
        self, requests: list[ExecRequest], *, concurrency: int | None = None
    ) -> list[dict[str, Any]]:
        n = len(self.actors)
        bounds = [len(requests) * j // n for j in range(n + 1)]
        parts = [(j, requests[bounds[j] : bounds[j + 1]]) for j in range(n) if bounds[j] < bounds[j + 1]]
        sent = [(j, part, self.actors[j].execute_many.remote(part, concurrency)) for j, part in parts]
        results: list[dict[str, Any]] = []
        for j, part, future in sent:
            for attempt in range(self.max_retries + 1):
                try:
                    results += ray.get(future)
                    break
                except DIED as e:
                    if attempt == self.max_retries:
                        raise RuntimeError(
                            f"sandbox actors died {attempt + 1} times on one batch; last: {e}"
                        ) from e
                    self.retries += 1
                    j = (j + 1) % n
                    future = self.actors[j].execute_many.remote(part, concurrency)
        return results

    def close(self) -> None:
        pass  # the actors belong to the pool
