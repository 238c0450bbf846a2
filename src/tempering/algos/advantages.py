"""Advantage estimators: pure functions from rewards to per-token advantages and returns.

Every estimator has the same signature, so they sit in one registry and the loop calls whichever the
config names:

    fn(x: AdvantageInputs, *, <its hyper-parameters>) -> (advantages (B, T), returns (B, T))

`x.rewards` are sequence-level scores (the outcome reward, credited at the last response token).
`x.token_rewards` (B, T), optional, are per-token terms added on top: a KL penalty used as a reward, or
per-step process rewards credited at the last token of each step. Sequence-level estimators (GRPO, RLOO)
fold them into the sequence reward; token-level ones (REINFORCE++, GAE) credit them where they occur.
Hyper-parameters are keyword-only and explicit: the run binds each estimator to the ones it declares
when it is built (`training.algorithm.bind_estimator`), so a misspelt one is an error there, not a no-op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tempering.algos.inputs import AdvantageInputs
from tempering.algos.masked import masked_whiten


def group_mean_std(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample mean, unbiased std and size of the sample's group. rewards (B,), group_ids (B,) -> 3 x (B,)."""
    _, g = torch.unique(group_ids, return_inverse=True)  # (B,) dense group index
    n = torch.bincount(g).to(rewards.dtype)  # (num_groups,)
    mean = torch.bincount(g, weights=rewards) / n  # (num_groups,)
    centred = rewards - mean[g]  # (B,)
    var = torch.bincount(g, weights=centred**2) / (n - 1).clamp_min(1)
    return mean[g], var[g].sqrt(), n[g]


def sequence_rewards(rewards: Tensor, response_mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """Outcome reward plus the sum of any per-token rewards of the sequence. -> (B,)"""
    if token_rewards is None:
        return rewards
    return rewards + (token_rewards * response_mask).sum(-1)


def last_token_rewards(rewards: Tensor, response_mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """Per-token rewards (B, T): `rewards` at each sequence's last response token, plus `token_rewards`.
    The mask may have gaps (a multi-turn episode's observation tokens): "last" is the last masked-in token."""
    steps = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = (response_mask * steps).argmax(-1)  # (B,)
    out = torch.zeros_like(response_mask, dtype=rewards.dtype)
    has = response_mask.sum(-1) > 0
    rows = torch.arange(len(rewards), device=rewards.device)[has]
    out[rows, last[has]] = rewards[has]
    if token_rewards is not None:
        out = out + token_rewards * response_mask
    return out


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = sum_{k>=t} gamma^(k-t) r_k over masked-in tokens (k counts only those: the reward
    flows across masked-out observation tokens unchanged). (B, T) -> (B, T)"""
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(response_mask[:, t] > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * response_mask


# --------------------------------------------------------------------------------- group baselines


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages (Shao et al. 2024, arXiv 2402.03300); scale_by_std=False is Dr. GRPO
    (Liu et al. 2025, arXiv 2503.20783).

    rewards (B,), group_ids (B,) -> advantages (B,), broadcast over response tokens by the caller.
    """
    mean, std, _ = group_mean_std(rewards, group_ids)
    adv = rewards - mean  # (B,)
    if scale_by_std:
        adv = adv / (std + eps)
    return adv


def grpo(x: AdvantageInputs, *, scale_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """GRPO: A_i = (r_i - mean_group) / (std_group + eps) on every response token; returns = advantages."""
    r = sequence_rewards(x.rewards, x.response_mask, x.token_rewards)
    adv = grpo_advantages(r, x.group_ids, scale_by_std=scale_by_std, eps=eps)[:, None] * x.response_mask
    return adv, adv  # (B, T), (B, T)


def dr_grpo(x: AdvantageInputs, *, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Dr. GRPO (arXiv 2503.20783): GRPO without the division by the group's std. Use it with
    `loss_agg: seq-mean-token-sum-norm` to also drop the length normalisation, as the paper does."""
    return grpo(x, scale_by_std=False, eps=eps)


def rloo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740):
    A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_group). A group of one gets 0."""
    r = sequence_rewards(x.rewards, x.response_mask, x.token_rewards)
    mean, _std, n = group_mean_std(r, x.group_ids)
    adv = torch.where(n > 1, (r - mean) * n / (n - 1).clamp_min(1), torch.zeros_like(r))
    adv = adv[:, None] * x.response_mask
    return adv, adv


def reinforce_pp(x: AdvantageInputs, *, gamma: float = 1.0, baseline: str = "none") -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): token-level reward-to-go (outcome at the last token plus
    per-token rewards such as a KL penalty), whitened over the whole batch - no critic, no group baseline.
    `baseline="group"` is REINFORCE++-baseline: the group's mean outcome is subtracted first."""
    rewards, mask = x.rewards, x.response_mask
    if baseline == "group":
        rewards = rewards - group_mean_std(rewards, x.group_ids)[0]
    elif baseline != "none":
        raise ValueError(f"reinforce_pp baseline must be 'none' or 'group', not '{baseline}'")
    returns = discounted_returns(last_token_rewards(rewards, mask, x.token_rewards), mask, gamma)
    adv = masked_whiten(returns, mask) * mask
    return adv, returns


def reinforce_pp_baseline(x: AdvantageInputs, *, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with the group's mean outcome as the baseline (`reinforce_pp(baseline="group")`)."""
    return reinforce_pp(x, gamma=gamma, baseline="group")


# ---------------------------------------------------------------------------------------- critic


def gae(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438) with a critic.

    values (B, T): V(s_t), the critic's estimate before response token t. With per-token rewards r_t,
    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token = 0),  A_t = delta_t + gamma * lam * A_{t+1},
    returns_t = A_t + V_t (the critic's regression target). lam = gamma = 1 gives A_t = G_t - V_t.
    Masked-out tokens inside a sequence (observations) are skipped: t+1 is the next policy token.
    """
    if x.values is None:
        raise ValueError("gae needs critic values: set algo.critic (see docs/concepts/algorithms.md)")
    response_mask = x.response_mask
    r = last_token_rewards(x.rewards, response_mask, x.token_rewards)
    values = x.values * response_mask
    adv = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    next_value = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        m = response_mask[:, t]
        delta = r[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m > 0, delta + gamma * lam * running, running)
        adv[:, t] = running
        next_value = torch.where(m > 0, values[:, t], next_value)
    returns = (adv + values) * response_mask
    return adv * response_mask, returns


AdvantageEstimator = Callable[
    ..., tuple[Tensor, Tensor]
]  # (AdvantageInputs, *, hyper) -> (advantages, returns)

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": gae,
}
gae.needs_critic = True  # type: ignore[attr-defined]  # a property of the estimator: user estimators that read `values` set it too


def needs_critic(estimator: AdvantageEstimator) -> bool:
    """Whether the estimator reads critic values (`fn.needs_critic = True`), so the trainer must keep one.
    A bound estimator (a `functools.partial`) answers for the function it binds."""
    return bool(getattr(getattr(estimator, "func", estimator), "needs_critic", False))
