"""Train/inference mismatch correction (verl's decoupled `rollout_correction`; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training").

The tokens were sampled by a behaviour policy mu (the rollout engine: another numerics, or an older
version when rollouts run ahead of the trainer); the trainer recomputes pi_old, the policy it is about to
update, and the PPO ratio becomes pi_theta / pi_old. What remains is weighted by w = pi_old / mu:

    tis  (truncated importance sampling)  w = min(pi_old / mu, cap)
    mis  (masked importance sampling)     w = 1[pi_old / mu <= cap]      (the token or sequence is dropped)

At `level="sequence"` the ratio is the sequence's geometric mean, exp(mean over its policy tokens of
log pi_old - log mu), and every token of the sequence gets that weight. Weights carry no gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from tempering.algos.kl import kl_k3
from tempering.algos.masked import masked_mean

CORRECTIONS = ("none", "tis", "mis")


@torch.no_grad()
def rollout_correction(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *,
                       mode: Literal["tis", "mis"], level: Literal["token", "sequence"] = "token",
                       cap: float = 2.0) -> tuple[Tensor, dict[str, float]]:
    """Importance weights (B, T) of pi_old / mu, truncated (tis) or masked (mis) at `cap`; zero off `mask`.
    Metrics: `mismatch/kl` (k3 estimate of KL(mu || pi_old) per token), `mismatch/is_weight/mean` (over the
    masked tokens, after truncation or masking), `mismatch/clip_frac` (tis) or `mismatch/masked_frac` (mis)."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"unknown correction '{mode}'; valid: tis, mis")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown correction level '{level}'; valid: token, sequence")
    if cap <= 0:
        raise ValueError(f"the correction cap must be > 0, not {cap}")
    log_ratio = (old_logprobs - behaviour_logprobs) * mask                   # (B, T)
    if level == "sequence":
        per_sequence = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)         # (B,) log of the geometric mean
        log_ratio = per_sequence[:, None].expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    over = ratio > cap
    if mode == "tis":
        weights, name = ratio.clamp(max=cap), "mismatch/clip_frac"
    else:
        weights, name = (~over).to(ratio.dtype), "mismatch/masked_frac"
    weights = weights * mask
    metrics = {
        "mismatch/kl": float(masked_mean(kl_k3(behaviour_logprobs, old_logprobs), mask)),
        "mismatch/is_weight/mean": float(masked_mean(weights, mask)),
        name: float(masked_mean(over.to(ratio.dtype), mask)),
    }
    return weights, metrics
