"""The mismatch correction (`algos.correction`) against hand-computed values."""

import math

import pytest
import torch

from tempering.algos import LossInputs, ppo_clip_loss
from tempering.algos.correction import rollout_correction

OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -3.0, 0.0, 0.0]])
MU = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.2, -4.5, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_token_tis_truncates_each_ratio_at_the_cap():
    w, mask, m = rollout_correction(OLD, MU, MASK, mode="tis", level="token", cap=2.0)
    assert torch.equal(mask, MASK)  # truncation rejects nothing
    # ratios: e^0.5 = 1.649, e^-1 = 0.368, 1; 1, e^1.5 = 4.48 -> 2
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    assert torch.allclose(w, expected)
    assert m["mismatch/clip_frac"] == pytest.approx(1 / 5)
    assert m["mismatch/is_weight/mean"] == pytest.approx(float(expected.sum()) / 5)


def test_token_mis_drops_the_tokens_over_the_cap():
    w, mask, m = rollout_correction(OLD, MU, MASK, mode="mis", level="token", cap=2.0)
    assert w is None
    assert mask.tolist() == [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert m["mismatch/masked_frac"] == pytest.approx(1 / 5)  # of the policy's 5 tokens, not the 4 kept
    assert m["mismatch/is_weight/mean"] == pytest.approx(4 / 5)


def test_sequence_level_uses_the_geometric_mean_of_the_sequence():
    w, _, _ = rollout_correction(OLD, MU, MASK, mode="tis", level="sequence", cap=2.0)
    first = math.exp((0.5 - 1.0 + 0.0) / 3)  # mean log-ratio over its 3 tokens
    assert math.exp((0.0 + 1.5) / 2) > 2.0  # the second sequence: capped
    assert torch.allclose(w, torch.tensor([[first] * 3 + [0.0], [2.0, 2.0, 0.0, 0.0]]))
    _, mask, m = rollout_correction(OLD, MU, MASK, mode="mis", level="sequence", cap=2.0)
    assert mask.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert m["mismatch/masked_frac"] == pytest.approx(2 / 5)


def test_no_mismatch_means_weight_one_and_zero_kl():
    w, _, m = rollout_correction(OLD, OLD, MASK, mode="tis")
    assert torch.equal(w, MASK)
    assert m["mismatch/kl"] == 0.0 and m["mismatch/is_weight/mean"] == 1.0


def test_the_mismatch_kl_is_k3_of_mu_against_pi_old():
    _, _, m = rollout_correction(OLD, MU, MASK, mode="tis")
    r = (OLD - MU)[MASK.bool()]  # log pi_old - log mu, tokens sampled from mu
    assert m["mismatch/kl"] == pytest.approx(float((torch.exp(r) - 1 - r).mean()))


def test_weights_carry_no_gradient_and_scale_the_token_losses():
    old = OLD.clone().requires_grad_(True)
    w, _, _ = rollout_correction(old, MU, MASK, mode="tis")
    assert not w.requires_grad
    logprobs = OLD.clone().requires_grad_(True)
    adv = torch.ones_like(OLD)
    plain, _ = ppo_clip_loss(LossInputs(logprobs, OLD, adv, MASK), loss_agg="seq-mean-token-sum")
    weighted, _ = ppo_clip_loss(LossInputs(logprobs, OLD, adv, MASK, w), loss_agg="seq-mean-token-sum")
    # at ratio 1 each token's loss is -A = -1: the weighted sum is minus the weights' sum per sequence
    assert float(plain.detach()) == pytest.approx(-2.5)
    assert float(weighted.detach()) == pytest.approx(-float(w.sum(-1).mean()))
    weighted.backward()
    assert torch.allclose(logprobs.grad, -w / 2)  # d/dlogp of -w r A, mean over 2 sequences


# Per-token advantages, all different, at ratio 1 (logprobs = OLD): each token's PPO loss is -A.
ADV = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]])


def mis_loss(level: str, loss_agg: str) -> float:
    """The PPO loss of ADV under MIS, with the correction's loss mask as the update passes it."""
    weights, mask, _ = rollout_correction(OLD, MU, MASK, mode="mis", level=level, cap=2.0)
    loss, _ = ppo_clip_loss(LossInputs(OLD, OLD, ADV, mask, weights), loss_agg=loss_agg)
    return float(loss)


def test_token_mis_averages_over_the_kept_tokens_only():
    # token (1, 1) (A = 5) is rejected; kept: A = 1, 2, 3 | 4.
    assert mis_loss("token", "token-mean") == pytest.approx(-(1 + 2 + 3 + 4) / 4)  # old: -10 / 5
    assert mis_loss("token", "seq-mean-token-mean") == pytest.approx(-(6 / 3 + 4) / 2)  # old: -(2 + 2) / 2
    assert mis_loss("token", "seq-mean-token-sum") == pytest.approx(-(6 + 4) / 2)  # (sums: as before)


def test_sequence_mis_leaves_the_rejected_sequence_out_of_every_count():
    # the whole second sequence is rejected: the loss is the first sequence's alone.
    assert mis_loss("sequence", "token-mean") == pytest.approx(-6 / 3)  # old: -6 / 5
    assert mis_loss("sequence", "seq-mean-token-sum") == pytest.approx(-6.0)  # old: -6 / 2
    assert mis_loss("sequence", "seq-mean-token-mean") == pytest.approx(-2.0)  # old: -2 / 2
    assert mis_loss("sequence", "seq-mean-token-sum-norm") == pytest.approx(-6 / 4)  # old: -6 / 2 / 4


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown correction"):
        rollout_correction(OLD, MU, MASK, mode="bogus")
    with pytest.raises(ValueError, match="cap"):
        rollout_correction(OLD, MU, MASK, mode="tis", cap=0.0)
