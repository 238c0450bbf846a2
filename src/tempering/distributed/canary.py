"""The weight-sync canary: after a worker loads a version, it computes log-probs on a fixed probe and the
trainer compares them with its own. A sync that silently did nothing (verl #7495 shipped a LoRA run's
frozen base for two months) fails the check at the first version it happens in.

The probe is built from the run seed alone - the first held-out prompts, each followed by seeded random
tokens - so it is the same after a resume. Checks, per (worker, version): the largest |difference| is at
most `tol`; and if the trainer's probe moved by more than 10 tol since the previous checked version, the
worker's must have moved by at least half as much (a no-op load under a loose tolerance)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tempering.errors import TemperingError
from tempering.inference.generation import left_pad


class WeightSyncError(TemperingError):
    """A rollout worker samples from other weights than the trainer's."""


@dataclass
class Probe:
    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    attention: Tensor

    @classmethod
    def build(cls, prompts: list[list[int]], vocab_size: int, seed: int, tokens: int = 32) -> Probe:
        prompt_ids, prompt_mask = left_pad(prompts, 0)
        g = torch.Generator().manual_seed(seed)
        response = torch.randint(0, vocab_size, (len(prompts), tokens), generator=g)
        return cls(prompt_ids, prompt_mask, response, torch.ones(response.shape))

    def logprobs(self, engine) -> Tensor:
        return engine.logprobs(self.prompt_ids, self.prompt_mask, self.response_ids, self.attention)


def check(
    worker: str,
    version: int,
    mine: Tensor,
    theirs: Tensor,
    tol: float,
    *,
    mine_before: Tensor | None = None,
    theirs_before: Tensor | None = None,
    my_prints: dict[str, float] | None = None,
    their_prints: dict[str, float] | None = None,
) -> float:
    """max |mine - theirs|; raises `WeightSyncError` naming the worker, the version and the first tensor whose
    fingerprints differ, when a check fails."""
    diff = float((mine - theirs).abs().max())
    problem = None
    if not diff <= tol:
        problem = f"probe log-probs differ by up to {diff:.3g} (tolerance {tol:g})"
    elif mine_before is not None and theirs_before is not None:
        moved, their_move = (
            float((mine - mine_before).abs().max()),
            float((theirs - theirs_before).abs().max()),
        )
        if moved > 10 * tol and their_move < moved / 2:
            problem = f"the trainer's probe moved by {moved:.3g} since the last check, the worker's by {their_move:.3g}"
    if problem is None:
        return diff
    where = ""
    if my_prints and their_prints is not None:
        bad = [
            n
            for n in my_prints
            if n not in their_prints
            or abs(my_prints[n] - their_prints[n]) > 1e-6 * max(1.0, abs(my_prints[n]))
        ]
        if bad:
            where = f"; first differing tensor: {bad[0]} ({len(bad)} of {len(my_prints)} differ)"
    raise WeightSyncError(f"weight sync failed on {worker} at version {version}: {problem}{where}")


def compare_replicas(
    mine: dict[str, float], theirs: dict[int, dict[str, float]], step: int, what: str = "policy"
) -> None:
    """Data-parallel ranks must hold the same bits after every step: raises `WeightSyncError` naming the first
    rank and tensor whose fingerprints differ from rank 0's (`mine`)."""
    for rank, prints in sorted(theirs.items()):
        bad = [n for n in mine if prints.get(n) != mine[n]]
        if bad:
            raise WeightSyncError(
                f"trainer rank {rank} holds other {what} weights than rank 0 at step {step}: "
                f"first differing tensor: {bad[0]} ({len(bad)} of {len(mine)} differ)"
            )
