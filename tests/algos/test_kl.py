"""The adaptive KL controller against Ziegler et al. 2019 (arXiv 1909.08593), eq. 2:
e_t = clip(KL_t / KL_target - 1, -0.2, 0.2);  beta_{t+1} = beta_t * (1 + K_beta * e_t),  K_beta = n_t / horizon,
where n_t is the number of samples in the step."""

import math
import random

import pytest

from tempering.algos import KLController


def paper_update(beta: float, kl: float, target: float, n: int, horizon: int) -> float:
    e = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + e * n / horizon)


def test_hand_computed_steps():
    cases = [  # (observed KL, samples in the step, coefficient after, from beta = 0.1, target 0.01, horizon 10000)
        (0.011, 64, 0.1 * (1 + 0.1 * 64 / 10000)),  # 10% over target: e = 0.1 -> 0.1000064
        (0.05, 64, 0.1 * (1 + 0.2 * 64 / 10000)),  # far over: clipped at +0.2 -> 0.100128
        (0.0, 256, 0.1 * (1 - 0.2 * 256 / 10000)),  # far under: clipped at -0.2 -> 0.099488
        (0.009, 10, 0.1 * (1 - 0.1 * 10 / 10000)),
    ]
    for kl, n, expected in cases:
        ctl = KLController(0.1, target=0.01, horizon=10000)
        ctl.update(kl, n_steps=n)
        assert ctl.coef == pytest.approx(expected, rel=1e-12)
    assert cases[1][2] == pytest.approx(0.100128) and cases[2][2] == pytest.approx(0.099488)


def test_matches_the_paper_over_a_random_run():
    rng = random.Random(0)
    ctl, beta = KLController(0.05, target=0.02, horizon=5000), 0.05
    for _ in range(500):
        kl, n = rng.uniform(0.0, 0.06), rng.choice([16, 64, 256])
        ctl.update(kl, n_steps=n)
        beta = paper_update(beta, kl, 0.02, n, 5000)
    assert ctl.coef == pytest.approx(beta, rel=1e-9)


def test_the_coefficient_moves_materially_over_a_realistic_run():
    # 32 prompts x 8 samples a step, KL steadily twice the target: the coefficient should grow ~2.8x in 200
    # steps. Counting one "sample" per step (the old call) it would have moved by 0.4%.
    ctl = KLController(0.1, target=0.01, horizon=10000)
    for _ in range(200):
        ctl.update(0.02, n_steps=32 * 8)
    assert ctl.coef == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) ** 200)
    assert ctl.coef > 0.25
    ctl = KLController(0.1, target=0.01, horizon=10000)
    for _ in range(200):
        ctl.update(0.0, n_steps=256)  # a policy that stays on the reference: the penalty decays
    assert ctl.coef < 0.04


def test_the_caller_says_how_many_samples_and_a_fixed_coefficient_stays():
    with pytest.raises(TypeError):
        KLController(0.1, target=0.01).update(0.02)  # n_steps is required: counting steps was the bug
    fixed = KLController(0.1)
    fixed.update(5.0, n_steps=256)
    assert fixed.coef == 0.1 and not fixed.adaptive


def test_the_kl_reward_is_minus_coef_times_the_estimate_on_the_policy_tokens():
    """k1 on hand-picked log-probs: log_ratio = logprobs - ref = [[0.5, -0.2, (padding)], [0.1, 0.3, 0.4]]."""
    import torch

    from tempering.algos import kl_reward

    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.7, -0.1]])
    ref = torch.tensor([[-1.5, -1.8, -1.0], [-0.6, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    penalty, kl = kl_reward(logprobs, ref, mask, coef=0.1, estimator="k1")
    torch.testing.assert_close(penalty, torch.tensor([[-0.05, 0.02, 0.0], [-0.01, -0.03, -0.04]]))
    assert float(kl) == pytest.approx((0.5 - 0.2 + 0.1 + 0.3 + 0.4) / 5)  # mean over the 5 policy tokens
    penalty3, kl3 = kl_reward(logprobs, ref, mask, coef=2.0)  # k3 by default: >= 0, so the penalty is <= 0
    assert (penalty3 <= 0).all() and float(penalty3[0, 2]) == 0.0 and float(kl3) > 0
    r = -0.5  # k3 of the first token: exp(ref - logp) - 1 - (ref - logp)
    assert float(penalty3[0, 0]) == pytest.approx(-2.0 * (math.exp(r) - 1 - r))
