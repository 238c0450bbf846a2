"""RLOO, REINFORCE++ (and its baseline variant), GAE and Dr. GRPO: each against a slow loop reference,
a hand-computed case, and a property."""

import pytest
import torch

from tempering.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    discounted_returns,
    dr_grpo,
    gae,
    reinforce_pp,
    rloo,
)


def ragged(seed=0, b=12, t=6, groups=3):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(b, generator=gen)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    group_ids = torch.arange(b) % groups
    values = torch.randn(b, t, generator=gen) * mask
    return rewards, mask, group_ids, values


# ----------------------------------------------------------------------------------------- RLOO


def rloo_loop(rewards, group_ids):
    out = []
    for i, (r, g) in enumerate(zip(rewards, group_ids)):
        others = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def test_rloo_matches_loop_reference_and_sums_to_zero_per_group():
    rewards, mask, group_ids, _ = ragged()
    adv, _ = rloo(AdvantageInputs(rewards, mask, group_ids))
    want = torch.tensor(rloo_loop(rewards.tolist(), group_ids.tolist()))
    torch.testing.assert_close(adv[:, 0], want, atol=1e-6, rtol=1e-6)
    for g in group_ids.unique():
        assert abs(float(adv[group_ids == g, 0].sum())) < 1e-5
    assert (adv[mask == 0] == 0).all()


def test_rloo_hand_computed():
    # Group [1, 0, 0]: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 twice. A lone sample gets 0.
    x = AdvantageInputs(torch.tensor([1.0, 0.0, 0.0, 0.7]), torch.ones(4, 1), torch.tensor([0, 0, 0, 1]))
    adv, _ = rloo(x)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 0.0]))


# ---------------------------------------------------------------------------------- REINFORCE++


def returns_loop(token_rewards, mask, gamma):
    out = []
    for row_r, row_m in zip(token_rewards, mask):
        n = int(sum(row_m))
        row = [0.0] * len(row_r)
        for t in range(n):
            row[t] = sum(gamma ** (k - t) * row_r[k] for k in range(t, n))
        out.append(row)
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_matches_loop(gamma):
    _, mask, _, values = ragged(1)
    got = discounted_returns(values, mask, gamma)
    want = torch.tensor(returns_loop(values.tolist(), mask.tolist(), gamma))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_hand_computed_and_whitened():
    # Two sequences of 2 tokens, rewards 1 and 0, gamma 1: returns [[1, 1], [0, 0]] -> whitened +-0.866
    # (unbiased std over the 4 tokens = sqrt(1/3)).
    mask = torch.ones(2, 2)
    adv, returns = reinforce_pp(AdvantageInputs(torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 1])))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.8660254, 0.8660254], [-0.8660254, -0.8660254]]))
    rewards, mask, group_ids, _ = ragged(2)
    adv, _ = reinforce_pp(AdvantageInputs(rewards, mask, group_ids))
    assert abs(float((adv * mask).sum() / mask.sum())) < 1e-5


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    rewards, mask, group_ids, _ = ragged(3)
    shifted = rewards + 5.0 * (group_ids == 1).float()  # a per-group offset is removed by the baseline
    a, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](AdvantageInputs(rewards, mask, group_ids))
    b, _ = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](AdvantageInputs(shifted, mask, group_ids))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    c, _ = reinforce_pp(AdvantageInputs(shifted, mask, group_ids))
    assert not torch.allclose(a, c, atol=1e-2)


def test_token_rewards_are_credited_where_they_occur():
    mask = torch.ones(1, 3)
    token_rewards = torch.tensor([[0.0, 0.5, 0.0]])
    returns = discounted_returns(torch.tensor([[0.0, 0.5, 1.0]]), mask)  # what reinforce_pp should build
    _, got = reinforce_pp(
        AdvantageInputs(torch.tensor([1.0]), mask, torch.tensor([0]), token_rewards=token_rewards)
    )
    torch.testing.assert_close(got, returns)


# ------------------------------------------------------------------------------------------ GAE


def gae_loop(rewards, mask, values, gamma, lam):
    advs, rets = [], []
    for r, m, v in zip(rewards, mask, values):
        n = int(sum(m))
        token_r = [0.0] * n
        if n:
            token_r[-1] = r
        adv = [0.0] * len(m)
        last = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            delta = token_r[t] + gamma * next_v - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append([adv[t] + (v[t] if t < n else 0.0) for t in range(len(m))])
    return advs, rets


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_matches_loop_reference(gamma, lam):
    rewards, mask, group_ids, values = ragged(4)
    adv, ret = gae(AdvantageInputs(rewards, mask, group_ids, values), gamma=gamma, lam=lam)
    want_adv, want_ret = gae_loop(rewards.tolist(), mask.tolist(), values.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(want_ret) * mask, atol=1e-5, rtol=1e-5)


def test_gae_with_lambda_and_gamma_one_and_zero_values_is_reward_to_go():
    rewards, mask, group_ids, values = ragged(5)
    token_rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9)) * mask
    x = AdvantageInputs(rewards, mask, group_ids, torch.zeros_like(values), token_rewards=token_rewards)
    adv, _ = gae(x, gamma=1.0, lam=1.0)
    lengths = mask.sum(1).long()
    per_token = token_rewards.clone()
    per_token[torch.arange(len(rewards)), lengths - 1] += rewards
    torch.testing.assert_close(adv, discounted_returns(per_token, mask), atol=1e-5, rtol=1e-5)


def test_gae_hand_computed():
    # One sequence of 2 tokens, V = [0.5, 0.2], reward 1 at the end, gamma = 1, lambda = 0.5:
    # delta_1 = 1 - 0.2 = 0.8, delta_0 = 0 + 0.2 - 0.5 = -0.3; A_1 = 0.8, A_0 = -0.3 + 0.5 * 0.8 = 0.1.
    x = AdvantageInputs(torch.tensor([1.0]), torch.ones(1, 2), torch.tensor([0]), torch.tensor([[0.5, 0.2]]))
    adv, ret = gae(x, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.1, 0.8]]))
    torch.testing.assert_close(ret, torch.tensor([[0.6, 1.0]]))


def test_gae_needs_values():
    with pytest.raises(ValueError, match="critic"):
        gae(AdvantageInputs(torch.tensor([1.0]), torch.ones(1, 2), torch.tensor([0])))


# ------------------------------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_is_grpo_without_std_and_invariant_to_shifts():
    rewards, mask, group_ids, _ = ragged(6)
    a, _ = dr_grpo(AdvantageInputs(rewards, mask, group_ids))
    b, _ = dr_grpo(AdvantageInputs(rewards + 2.5, mask, group_ids))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    doubled, _ = dr_grpo(AdvantageInputs(rewards * 2, mask, group_ids))
    torch.testing.assert_close(a[:, 0] * 2, doubled[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_binds_to_the_runs_keywords_and_masks_padding(name):
    from tempering.config import build_config
    from tempering.training.algorithm import bind_estimator

    rewards, mask, group_ids, values = ragged(7)
    x = AdvantageInputs(rewards, mask, group_ids, values=values)
    adv, ret = bind_estimator(build_config({"algo": {"estimator": name}}))(x)
    assert adv.shape == ret.shape == mask.shape
    assert (adv[mask == 0] == 0).all()


def test_needing_a_critic_is_a_property_of_the_estimator():
    from tempering.algos import ADVANTAGE_ESTIMATORS, needs_critic

    assert [n for n, fn in ADVANTAGE_ESTIMATORS.items() if needs_critic(fn)] == ["gae"]

    def my_estimator(x, **_):
        return x.values, x.values

    assert not needs_critic(my_estimator)
    my_estimator.needs_critic = True  # a user estimator that reads `values` says so
    assert needs_critic(my_estimator)
