"""Advantage estimators: pure functions from rewards to per-sequence or per-token advantages.

Every estimator has the same signature, so they sit in one registry and the loop calls whichever the
config names:

    fn(rewards (B,), response_mask (B, T), group_ids (B,), values=None, **hyper) -> (advantages (B, T), returns (B, T))

`rewards` are sequence-level scores (outcome reward, assigned at the last response token); hyper-parameters
the estimator does not use are accepted and ignored, so one call site serves all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def group_mean_std(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample mean, unbiased std and size of the sample's group. rewards (B,), group_ids (B,) -> 3 x (B,)."""
    _, g = torch.unique(group_ids, return_inverse=True)            # (B,) dense group index
    n = torch.bincount(g).to(rewards.dtype)                         # (num_groups,)
    mean = torch.bincount(g, weights=rewards) / n                   # (num_groups,)
    centred = rewards - mean[g]                                     # (B,)
    var = torch.bincount(g, weights=centred**2) / (n - 1).clamp_min(1)
    return mean[g], var[g].sqrt(), n[g]


def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages (Shao et al. 2024, arXiv 2402.03300); scale_by_std=False is Dr. GRPO
    (Liu et al. 2025, arXiv 2503.20783).

    rewards (B,), group_ids (B,) -> advantages (B,), broadcast over response tokens by the caller.
    """
    mean, std, _ = group_mean_std(rewards, group_ids)
    adv = rewards - mean                                            # (B,)
    if scale_by_std:
        adv = adv / (std + eps)
    return adv


def grpo(
    rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    values: Tensor | None = None,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    **_: object,
) -> tuple[Tensor, Tensor]:
    """GRPO as a registry entry: the sequence advantage on every response token; returns = advantages."""
    adv = grpo_advantages(rewards, group_ids, scale_by_std=scale_by_std, eps=eps)[:, None] * response_mask
    return adv, adv                                                 # (B, T), (B, T)


AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo,
}
