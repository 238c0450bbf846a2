import pytest
import torch

from tempering.algos import ADVANTAGE_ESTIMATORS, AdvantageInputs, grpo, grpo_advantages, lookup


def grpo_loop(rewards, group_ids, scale_by_std=True, eps=1e-6):
    """Slow reference: one group at a time, with Python statistics."""
    out = [0.0] * len(rewards)
    for g in set(group_ids):
        idx = [i for i, x in enumerate(group_ids) if x == g]
        vals = [rewards[i] for i in idx]
        mean = sum(vals) / len(vals)
        var = sum((v - mean) ** 2 for v in vals) / max(1, len(vals) - 1)
        for i in idx:
            out[i] = (rewards[i] - mean) / ((var**0.5 + eps) if scale_by_std else 1.0)
    return out


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_loop_reference(scale_by_std):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=gen)
    group_ids = torch.randint(0, 5, (24,), generator=gen)
    got = grpo_advantages(rewards, group_ids, scale_by_std=scale_by_std)
    want = grpo_loop(rewards.tolist(), group_ids.tolist(), scale_by_std)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_grpo_hand_computed():
    # Group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3) -> +-0.866; group 1: all equal -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = grpo_advantages(rewards, group_ids)  # eps=1e-6 keeps the all-equal group at 0, not NaN
    torch.testing.assert_close(adv, torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254, 0.0, 0.0]))
    dr = grpo_advantages(rewards, group_ids, scale_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_grpo_invariant_to_shifting_rewards():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.rand(16, generator=gen)
    group_ids = torch.arange(16) // 4
    torch.testing.assert_close(
        grpo_advantages(rewards, group_ids), grpo_advantages(rewards + 3.7, group_ids), atol=1e-4, rtol=1e-4
    )


def test_grpo_registry_entry_broadcasts_over_response_tokens():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv, returns = grpo(AdvantageInputs(rewards, mask, torch.tensor([0, 0])))
    assert adv.shape == (2, 3)
    assert adv[0, 2] == 0 and adv[1, 1] == 0  # padding gets no advantage
    assert adv[0, 0] == adv[0, 1] > 0 > adv[1, 0]
    torch.testing.assert_close(adv, returns)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="valid: grpo"):
        lookup(ADVANTAGE_ESTIMATORS, "gea", "advantage estimator")
