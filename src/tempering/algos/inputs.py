"""The typed inputs of advantage estimators and policy losses: one dataclass each, so every function in a
registry takes the same thing and a new field (a policy version, a behaviour log-prob) reaches all of them.
Shapes: B = sequences, T = response tokens."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator sees. `rewards` (B,) are sequence-level scores, credited at the last response token;
    `token_rewards` (B, T), optional, are per-token terms on top (a KL penalty used as a reward, per-step
    process rewards); `values` (B, T) are the critic's V(s_t), for estimators that need a critic."""

    rewards: Tensor
    response_mask: Tensor
    group_ids: Tensor
    values: Tensor | None = None
    token_rewards: Tensor | None = None


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss sees, all (B, T): the current and the sampling policy's log-probs of the response
    tokens, their advantages, and the mask of tokens that count."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    weights: Tensor | None = None
    """Per-token truncated importance weights of the mismatch correction (`algos.correction`, tis), no
    gradient; None = 1. Tokens the correction rejects (mis) are not weighted 0: they are out of `mask`."""

    def weighted(self, losses: Tensor) -> Tensor:
        """Per-token losses times the correction's weights (before aggregation)."""
        return losses if self.weights is None else losses * self.weights
