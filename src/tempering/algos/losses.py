"""Policy and value losses, and the reductions that turn per-token losses into one scalar.

One signature for every policy loss:

    fn(x: LossInputs, *, loss_agg, norm_length, <its hyper-parameters>) -> (loss scalar, metrics dict)

Hyper-parameters are keyword-only and explicit; the run binds each loss to the ones it declares once, when
it is built (`tempering.training.algorithm.bind_policy_loss`), and the update calls `loss(x)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tempering.algos.inputs import LossInputs
from tempering.algos.masked import masked_mean, sequence_mean

# --------------------------------------------------------------------------------- aggregations


def token_mean(losses: Tensor, mask: Tensor) -> Tensor:
    """Every response token in the batch weighs the same (DAPO's choice; verl `token-mean`)."""
    return masked_mean(losses, mask)


# The seq-mean aggregations average over the sequences that have a token in `mask`: a fully masked row (every
# token rejected by the mismatch correction) is not counted, as in verl's `agg_loss` (docs/concepts/algorithms.md).


def seq_mean_token_sum(losses: Tensor, mask: Tensor) -> Tensor:
    """Sum over each sequence's tokens, mean over sequences (long answers weigh more)."""
    return sequence_mean((losses * mask).sum(-1), mask)


def seq_mean_token_mean(losses: Tensor, mask: Tensor) -> Tensor:
    """Mean over each sequence's tokens, then over sequences (the original GRPO's per-sample average)."""
    return sequence_mean(masked_mean(losses, mask, dim=-1), mask)


def seq_mean_token_sum_norm(losses: Tensor, mask: Tensor, *, norm_length: int | None = None) -> Tensor:
    """Sum over tokens divided by a constant length (default the batch's T), mean over sequences:
    Dr. GRPO's unbiased aggregation (no per-sequence length normalisation). verl sums over sequences instead
    (no sequence count), which scales its loss by its micro-batch size."""
    return sequence_mean((losses * mask).sum(-1), mask) / float(norm_length or losses.shape[-1])


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate(losses: Tensor, mask: Tensor, loss_agg: str, norm_length: int | None = None) -> Tensor:
    """`LOSS_AGGREGATIONS[loss_agg]` of (B, T) losses -> scalar; `norm_length` is the one aggregation's that
    divides by a constant length (seq-mean-token-sum-norm; None = the batch's T)."""
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg '{loss_agg}'; valid: {', '.join(LOSS_AGGREGATIONS)}")
    if loss_agg == "seq-mean-token-sum-norm":
        return seq_mean_token_sum_norm(losses, mask, norm_length=norm_length)
    return LOSS_AGGREGATIONS[loss_agg](losses, mask)


# -------------------------------------------------------------------------------- policy losses


def clip_range(clip_ratio: float, low: float | None, high: float | None) -> tuple[float, float]:
    """(eps_low, eps_high): each side's own value, or `clip_ratio`."""
    return clip_ratio if low is None else low, clip_ratio if high is None else high


def ppo_clip_loss(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), per token.

    loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),  r_t = exp(logprobs - old_logprobs).
    eps_low / eps_high default to `clip_ratio`; a larger eps_high is DAPO's clip-higher (arXiv 2503.14476).
    `clip_ratio_c` (> 1) is dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): for A_t < 0 the loss is at
    most -c A_t, so a huge ratio on a bad token cannot blow the update up.
    """
    advantages, mask = x.advantages, x.mask
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = x.logprobs - x.old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)  # (B, T)
    dual = None
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, not {clip_ratio_c}")
        capped = torch.minimum(losses, -advantages * clip_ratio_c)
        dual = (advantages < 0) & (capped < losses)
        losses = torch.where(advantages < 0, capped, losses)
    loss = aggregate(x.weighted(losses), mask, loss_agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),  # approx KL(old || new), k1
        }
        if dual is not None:
            metrics["pg_clipfrac_lower"] = masked_mean(dual.float(), mask)
    return loss, metrics


def vanilla_pg_loss(
    x: LossInputs, *, loss_agg: str = "token-mean", norm_length: int | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient: -A_t * r_t (equal to -A_t log pi at r = 1, with the same gradient)."""
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    loss = aggregate(x.weighted(-x.advantages * ratio), x.mask, loss_agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": x.logprobs.new_zeros(()),
            "ppo_kl": masked_mean(x.old_logprobs - x.logprobs, x.mask),
        }
    return loss, metrics


def gspo_loss(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    loss_agg: str = "seq-mean-token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one importance ratio per sequence, the geometric mean of its
    tokens' ratios, s_i = (pi(y_i | x) / pi_old(y_i | x))^(1 / |y_i|), clipped as PPO clips a token's:

        loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i).

    Computed in the paper's token form (GSPO-token, eq. 13): s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], which
    equals s_i in value and has s_i's gradient when A is the same on every token of a sequence (outcome
    rewards), and also takes per-token advantages. The paper's objective averages over sequences:
    `loss_agg: seq-mean-token-mean`; its clip ranges are tiny (eps_low 3e-4, eps_high 4e-4) because a
    sequence's ratio moves much less than a token's. The log-ratio is capped at 10 before exp (as verl does).
    """
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = x.logprobs - x.old_logprobs
    seq_log_ratio = masked_mean(log_ratio, x.mask, dim=-1)  # (B,) log s_i
    log_s = (x.logprobs - x.logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)  # (B, T): s_i, with token gradients
    unclipped = -x.advantages * s
    clipped = -x.advantages * s.clamp(1.0 - low, 1.0 + high)
    losses = torch.maximum(unclipped, clipped)
    loss = aggregate(x.weighted(losses), x.mask, loss_agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).float(), x.mask),
            "ppo_kl": masked_mean(-log_ratio, x.mask),
        }
    return loss, metrics


def cispo_loss(
    x: LossInputs,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    loss_agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): no token loses its gradient to clipping; its importance weight is
    clipped instead, and carries no gradient:

        loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t),   r_t = pi(y_t) / pi_old(y_t).

    So the gradient is the REINFORCE one, -w_t A_t grad log pi, with w_t bounded (PPO-clip instead gives 0 for a
    token whose ratio left the range in the advantage's direction). The paper aggregates token-mean, sets
    no lower bound in practice (a large eps_low) and tunes eps_high."""
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = x.logprobs - x.old_logprobs
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(max(0.0, 1.0 - low), 1.0 + high)
    losses = -x.advantages * weight * x.logprobs
    loss = aggregate(x.weighted(losses), x.mask, loss_agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((weight != ratio).float(), x.mask),
            "ppo_kl": masked_mean(-log_ratio, x.mask),
        }
    return loss, metrics


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]  # (LossInputs, *, hyper) -> (loss, metrics)

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
    "vanilla": vanilla_pg_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


# ----------------------------------------------------------------------------------- value loss


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float = 0.2,
    loss_agg: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    losses = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = aggregate(losses, mask, loss_agg)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean(((clipped - returns) ** 2 > (values - returns) ** 2).float(), mask),
            "values/mean": masked_mean(values, mask),
        }
    return loss, metrics
