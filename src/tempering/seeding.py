"""The run's random streams: every random choice of step s (sampling, minibatch order, validation, the
critic's minibatches) comes from a generator seeded by (run seed, s, stream), independent of everything
that ran before - so a resumed run needs no generator state to continue identically."""

from __future__ import annotations

import torch


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """The seed of one purpose (stream) of one step, independent of everything that ran before."""
    return (seed * 1_000_003 + step) * 16 + stream


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(step_seed(seed, step, stream))
