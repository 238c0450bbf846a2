"""A policy loss of one's own, named as `algo.policy_loss` by import path. It takes the `LossInputs` and, as
keyword-only parameters, whichever of the run's loss hyper-parameters it declares (the clipping keywords,
`loss_agg`, `norm_length`: `tempering.training.algorithm.loss_hyper`), bound once when the run is built; it
returns the loss and metrics, which are logged as `actor/<name>`."""

from __future__ import annotations

import torch
from torch import Tensor

from tempering.algos import LossInputs, aggregate, masked_mean
from tempering.algos.losses import clip_range


def hard_clip_loss(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    loss_agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """-A_t * clip(r_t, 1 - eps_low, 1 + eps_high): PPO's clipped term without its min, so a token whose ratio
    left the trust region gets no gradient on either side (PPO still pushes back one that moved the wrong
    way). It declares no `clip_ratio_c` (PPO's dual clip has no meaning here), so the run does not pass it."""
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    ratio = torch.exp(x.logprobs - x.old_logprobs)  # (B, T)
    clipped = ratio.clamp(1.0 - low, 1.0 + high)
    losses = x.weighted(-x.advantages * clipped)  # (B, T)
    loss = aggregate(losses, x.mask, loss_agg, norm_length)
    with torch.no_grad():
        outside = (ratio < 1.0 - low) | (ratio > 1.0 + high)
        metrics = {"hard_clipfrac": masked_mean(outside.float(), x.mask)}
    return loss, metrics
