"""Which policy version samples which step, and the shards a step's tasks are cut into - pure functions.

Asynchronous rollouts run with a fixed lag k (`rollout.max_staleness`): the batch of step s is sampled by
version v(s) = max(0, s - 1 - k), version v being the weights after step v. The bound holds by
construction, so nothing is dropped and nobody waits on a stale sample: every sample's staleness, counted
from the oldest version that touched it (a trajectory is sampled by one version here), is min(k, s - 1).

A shard is a fixed slice of one sampling round's tasks, run end to end (generation, environments,
reward, collate) in one worker. Its result is a function of (its tasks, its seeds, the weights of its
version) alone, so the number of workers, retries and restarts change timing, never samples. With one
shard the seeds are exactly the synchronous loop's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tempering.seeding import step_seed
from tempering.types import Task


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version that samples the batch of `step`: the weights after step max(0, step - 1 - k)."""
    return max(0, step - 1 - max_staleness)


@dataclass(frozen=True)
class ShardSpec:
    """One unit of rollout work: `group_size` episodes of each of `tasks`, sampled by policy `version`."""

    step: int
    round: int
    """The DAPO sampling round (0 without dynamic sampling)."""
    shard: int
    tasks: tuple[Task, ...]
    first_task: int
    """Index of `tasks[0]` in the round: group ids and environment seeds stay those of the whole round."""
    generator_seed: int
    env_seed: int
    version: int

    @property
    def key(self) -> tuple[int, int, int]:
        return self.step, self.round, self.shard


def shard_specs(
    step: int, round_: int, tasks: list[Task], shards: int, seed: int, version: int
) -> list[ShardSpec]:
    """Cut a round's tasks into `shards` contiguous slices (sizes differ by at most one). Shard j samples with
    generator seed step_seed(...) + j * 1_000_000_007 (shard 0: the synchronous loop's own seed)."""
    generator = step_seed(seed, step, 0 if round_ == 0 else 10 + round_)
    env = step_seed(seed, step, 4 + round_)
    bounds = [len(tasks) * j // shards for j in range(shards + 1)]
    return [
        ShardSpec(
            step,
            round_,
            j,
            tuple(tasks[bounds[j] : bounds[j + 1]]),
            bounds[j],
            generator + j * 1_000_000_007,
            env,
            version,
        )
        for j in range(shards)
        if bounds[j] < bounds[j + 1]
    ]


def staleness_metrics(step: int, versions: torch.Tensor) -> dict[str, float]:
    """`async/staleness/{min,mean,max}`: how many updates behind the trained policy each sample's sampler was
    (step - 1 - its version)."""
    lag = (step - 1 - versions).float()
    return {
        "async/staleness/min": float(lag.min()),
        "async/staleness/mean": float(lag.mean()),
        "async/staleness/max": float(lag.max()),
    }
