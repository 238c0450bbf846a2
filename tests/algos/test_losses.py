import math

import torch

from tempering.algos import kl_k1, kl_k2, kl_k3, masked_mean, masked_whiten, ppo_clip_loss, token_mean


def ppo_loop(logp, old, adv, mask, eps):
    total, count = 0.0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if mask[i][t]:
                r = math.exp(logp[i][t] - old[i][t])
                clipped = min(max(r, 1 - eps), 1 + eps)
                total += -min(r * adv[i][t], clipped * adv[i][t])
                count += 1
    return total / count


def test_ppo_clip_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=gen)
    old = logp + 0.3 * torch.randn(6, 5, generator=gen)
    adv = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_ratio=0.2)
    assert math.isclose(float(loss), ppo_loop(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2),
                        rel_tol=1e-5)
    assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0


def test_ppo_clip_hand_computed():
    # ratio 1.5 with A=+1 is clipped to 1.2 -> loss -1.2; ratio 0.5 with A=+1 is not clipped (min) -> -0.5.
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    loss, metrics = ppo_clip_loss(logp, old, adv, torch.ones(1, 2), clip_ratio=0.2)
    assert math.isclose(float(loss), (-1.2 - 0.5) / 2, rel_tol=1e-6)
    assert float(metrics["pg_clipfrac"]) == 0.5


def test_ppo_on_policy_gradient_is_the_policy_gradient():
    # At ratio 1 the clipped objective's gradient equals -A * grad(logp) / N.
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, torch.ones(1, 3))
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 3)


def test_token_mean_ignores_padding():
    losses = torch.tensor([[1.0, 3.0, 100.0]])
    assert float(token_mean(losses, torch.tensor([[1.0, 1.0, 0.0]]))) == 2.0
    assert float(masked_mean(losses, torch.zeros(1, 3))) == 0.0  # all padding: 0, not NaN


def test_masked_whiten_has_zero_mean_unit_variance_on_the_mask():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4, 6, generator=gen) * 5 + 2
    mask = (torch.rand(4, 6, generator=gen) > 0.4).float()
    w = masked_whiten(values, mask)
    assert abs(float(masked_mean(w, mask))) < 1e-5
    sel = w[mask.bool()]
    assert abs(float(sel.var()) - 1.0) < 1e-4


def test_kl_estimators_hand_computed_and_k3_nonnegative():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_k1(logp, ref), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_k2(logp, ref), torch.tensor([[0.125, 0.5]]))
    expected = torch.tensor([[math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]])
    torch.testing.assert_close(kl_k3(logp, ref), expected)
    assert (kl_k3(-torch.rand(50, 7), -torch.rand(50, 7)) >= 0).all()


def test_k3_is_an_unbiased_kl_estimate():
    # Sample tokens from p; the mean of k3 over samples approaches KL(p || q).
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=gen), 0)
    q = torch.softmax(torch.randn(8, generator=gen), 0)
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    est = kl_k3(p.log()[tokens][None], q.log()[tokens][None]).mean()
    exact = (p * (p.log() - q.log())).sum()
    assert abs(float(est) - float(exact)) < 0.01
