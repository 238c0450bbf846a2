"""Policy losses and the reductions that turn per-token losses into one scalar.

One signature for every policy loss:

    fn(logprobs (B, T), old_logprobs (B, T), advantages (B, T), mask (B, T), *, loss_agg, **hyper)
        -> (loss scalar, metrics dict of scalar tensors)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tempering.algos.masked import masked_mean


def token_mean(losses: Tensor, mask: Tensor) -> Tensor:
    """Every response token in the batch weighs the same (DAPO's choice; verl `token-mean`)."""
    return masked_mean(losses, mask)


LOSS_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token-mean": token_mean,
}


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 0.2,
    loss_agg: str = "token-mean",
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), per token.

    loss_t = -min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t) with r_t = exp(logprobs - old_logprobs).
    """
    log_ratio = logprobs - old_logprobs                                  # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    losses = torch.maximum(unclipped, clipped)                           # (B, T)
    loss = LOSS_AGGREGATIONS[loss_agg](losses, mask)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),                     # approx KL(old || new), k1
        }
    return loss, metrics


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
}
