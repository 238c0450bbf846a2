"""Where shards run. A pool takes the weights of each version (`publish`), shards to run (`submit`, returns
a ticket at once) and gives their results back in shard order (`gather`); `metrics` are its figures for a
step's row, `pending_metrics` those gathered since (a checkpoint keeps them for the next row, which a
resumed run reports too: `restore_pending`). `LocalPool` runs them in this process with the trainer's own
weights - the reference every other backend must equal; `ray_pool.RayPool` runs them on rollout-worker
actors."""

from __future__ import annotations

from typing import Protocol

import torch

from tempering.config import RunConfig
from tempering.distributed.schedule import ShardSpec
from tempering.distributed.source import RolloutSource
from tempering.rollout.batch import Rollout, merge_rollouts


class Pool(Protocol):
    def publish(self, version: int, model: torch.nn.Module) -> None: ...
    def submit(self, specs: list[ShardSpec]) -> object: ...
    def gather(self, ticket: object) -> Rollout: ...
    def metrics(self) -> dict[str, float]: ...
    def pending_metrics(self) -> dict[str, float]: ...
    def restore_pending(self, figures: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class LocalPool:
    """Runs each shard when it is submitted, on `source` (whose engine samples from the trainer's policy):
    a shard of step s is submitted when the weights are those of its version, v(s) (`schedule`), so no
    older copy is ever needed."""

    def __init__(self, source: RolloutSource):
        self.source = source

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self.source.engine.load_weights(model.state_dict(), version=version)

    def submit(self, specs: list[ShardSpec]) -> list[Rollout]:
        return [self.source.run(spec) for spec in specs]

    def gather(self, ticket: list[Rollout]) -> Rollout:
        return merge_rollouts(ticket)

    def metrics(self) -> dict[str, float]:
        return {}

    def pending_metrics(self) -> dict[str, float]:
        return {}

    def restore_pending(self, figures: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def make_pool(cfg: RunConfig, source: RolloutSource, model: torch.nn.Module, probe, log=print) -> Pool:
    """The pool `distributed.backend` names (`source`: this process's, over the trainer's policy)."""
    if cfg.distributed.backend == "ray":
        from tempering.distributed.ray_pool import RayPool

        return RayPool(cfg, model, source.tokenizer, probe, reference=source.engine, log=log)
    return LocalPool(source)
