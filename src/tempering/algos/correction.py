"""Train/inference mismatch correction (verl's decoupled `rollout_correction`; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training").

The tokens were sampled by a behaviour policy mu (the rollout engine: another numerics, or an older
version when rollouts run ahead of the trainer); the trainer recomputes pi_old, the policy it is about to
update, and the PPO ratio becomes pi_theta / pi_old. What remains is weighted by w = pi_old / mu:

    tis  (truncated importance sampling)  w = min(pi_old / mu, cap)
    mis  (masked importance sampling)     keep = 1[pi_old / mu <= cap]   (the token or sequence is rejected)

At `level="sequence"` the ratio is the sequence's geometric mean, exp(mean over its policy tokens of
log pi_old - log mu), and every token of the sequence gets that weight. Weights carry no gradient.

A rejected token leaves the mask the update averages over, as verl's rejection sampling takes it out of
`response_mask`: the loss is the mean over the tokens kept, so rejecting a third of the tokens does not
shrink the step by a third (docs/concepts/algorithms.md, "Mismatch correction").
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from tempering.algos.kl import kl_k3
from tempering.algos.masked import masked_mean

CORRECTIONS = ("none", "tis", "mis")


@torch.no_grad()
def rollout_correction(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    mode: Literal["tis", "mis"],
    level: Literal["token", "sequence"] = "token",
    cap: float = 2.0,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """(weights, loss mask, metrics) for ratios pi_old / mu, all (B, T). tis: the weights truncated at `cap`
    (zero off `mask`) and `mask` itself; mis: no weights (None) and `mask` less the tokens over `cap`.
    Metrics, over `mask` (the policy's tokens, rejected ones included): `mismatch/kl` (k3 estimate of
    KL(mu || pi_old) per token), `mismatch/is_weight/mean` (the weight after truncation, 0 for a rejected
    token), `mismatch/clip_frac` (tis) or `mismatch/masked_frac` (mis: the fraction rejected)."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"unknown correction '{mode}'; valid: tis, mis")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown correction level '{level}'; valid: token, sequence")
    if cap <= 0:
        raise ValueError(f"the correction cap must be > 0, not {cap}")
    log_ratio = (old_logprobs - behaviour_logprobs) * mask  # (B, T)
    if level == "sequence":
        per_sequence = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,) log of the geometric mean
        log_ratio = per_sequence[:, None].expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    over = ratio > cap
    if mode == "tis":
        weights, loss_mask, name = ratio.clamp(max=cap) * mask, mask, "mismatch/clip_frac"
    else:
        weights, loss_mask, name = None, mask * ~over, "mismatch/masked_frac"
    metrics = {
        "mismatch/kl": float(masked_mean(kl_k3(behaviour_logprobs, old_logprobs), mask)),
        "mismatch/is_weight/mean": float(masked_mean(loss_mask if weights is None else weights, mask)),
        name: float(masked_mean(over.to(ratio.dtype), mask)),
    }
    return weights, loss_mask, metrics
