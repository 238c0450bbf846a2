import math

import pytest
import torch

from tempering.algos import (
    LOSS_AGGREGATIONS,
    LossInputs,
    clipped_value_loss,
    kl_k1,
    kl_k2,
    kl_k3,
    masked_mean,
    masked_whiten,
    ppo_clip_loss,
    token_mean,
)


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
    loss, metrics = ppo_clip_loss(LossInputs(logp, old, adv, mask), clip_ratio=0.2)
    assert math.isclose(
        float(loss), ppo_loop(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2), rel_tol=1e-5
    )
    assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0


def test_ppo_clip_hand_computed():
    # ratio 1.5 with A=+1 is clipped to 1.2 -> loss -1.2; ratio 0.5 with A=+1 is not clipped (min) -> -0.5.
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    loss, metrics = ppo_clip_loss(LossInputs(logp, old, adv, torch.ones(1, 2)), clip_ratio=0.2)
    assert math.isclose(float(loss), (-1.2 - 0.5) / 2, rel_tol=1e-6)
    assert float(metrics["pg_clipfrac"]) == 0.5


def test_ppo_on_policy_gradient_is_the_policy_gradient():
    # At ratio 1 the clipped objective's gradient equals -A * grad(logp) / N.
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, _ = ppo_clip_loss(LossInputs(logp, logp.detach(), adv, torch.ones(1, 3)))
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


# ----------------------------------------------------------------- clip-higher, dual-clip, aggregations


def ppo_loop_general(logp, old, adv, mask, low, high, c=None):
    rows = []
    for lr, orow, arow in zip(logp, old, adv):
        out = []
        for lp, op, a in zip(lr, orow, arow):
            ratio = math.exp(lp - op)
            loss = max(-a * ratio, -a * min(max(ratio, 1 - low), 1 + high))
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            out.append(loss)
        rows.append(out)
    return rows


@pytest.mark.parametrize("low,high,c", [(0.2, 0.28, None), (0.1, 0.3, 3.0), (0.2, 0.2, 1.5)])
def test_ppo_clip_higher_and_dual_clip_match_loop(low, high, c):
    gen = torch.Generator().manual_seed(3)
    logp, old = torch.randn(4, 5, generator=gen), torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, 5, generator=gen) * 2
    mask = torch.ones(4, 5)
    x = LossInputs(logp, old, adv, mask)
    loss, metrics = ppo_clip_loss(x, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    want = torch.tensor(
        ppo_loop_general(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), low, high, c)
    )
    torch.testing.assert_close(loss, want.mean(), atol=1e-5, rtol=1e-5)
    assert ("pg_clipfrac_lower" in metrics) == (c is not None)


def test_dual_clip_hand_computed():
    # ratio e^2 = 7.39 on a token with A = -1: PPO's loss would be 7.39; dual-clip with c = 3 caps it at 3.
    x = LossInputs(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    loss, _ = ppo_clip_loss(x, clip_ratio_c=3.0)
    assert float(loss) == pytest.approx(3.0)
    loss, _ = ppo_clip_loss(x)
    assert float(loss) == pytest.approx(math.exp(2.0))


def test_loss_aggregations_hand_computed():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    agg = LOSS_AGGREGATIONS
    assert float(agg["token-mean"](losses, mask)) == pytest.approx(10 / 4)
    assert float(agg["seq-mean-token-sum"](losses, mask)) == pytest.approx((6 + 4) / 2)
    assert float(agg["seq-mean-token-mean"](losses, mask)) == pytest.approx((2 + 4) / 2)
    assert float(agg["seq-mean-token-sum-norm"](losses, mask)) == pytest.approx((6 + 4) / 2 / 3)
    assert float(agg["seq-mean-token-sum-norm"](losses, mask, norm_length=10)) == pytest.approx(0.5)


def test_seq_mean_aggregations_leave_fully_masked_rows_out_of_the_count():
    # the third row has no token in the mask (say MIS rejected the whole sequence): verl's definition.
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    agg = LOSS_AGGREGATIONS
    assert float(agg["token-mean"](losses, mask)) == pytest.approx(10 / 4)
    assert float(agg["seq-mean-token-sum"](losses, mask)) == pytest.approx((6 + 4) / 2)  # not / 3
    assert float(agg["seq-mean-token-mean"](losses, mask)) == pytest.approx((2 + 4) / 2)  # not / 3
    assert float(agg["seq-mean-token-sum-norm"](losses, mask)) == pytest.approx(10 / 2 / 3)  # not / 3 / 3


@pytest.mark.parametrize("name", list(LOSS_AGGREGATIONS))
def test_a_fully_masked_row_changes_no_aggregation(name):
    gen = torch.Generator().manual_seed(3)
    losses = torch.randn(4, 5, generator=gen)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    more = torch.cat([losses, torch.randn(1, 5, generator=gen)]), torch.cat([mask, torch.zeros(1, 5)])
    agg = LOSS_AGGREGATIONS[name]
    torch.testing.assert_close(agg(*more), agg(losses, mask))
    assert float(agg(losses, torch.zeros_like(mask))) == 0.0  # nothing to learn from: 0, not NaN


def test_clipped_value_loss_hand_computed():
    # V_old = 0, V = 1, R = 1, clip 0.2: unclipped error 0, clipped V = 0.2 -> error 0.64; max -> 0.5 * 0.64.
    loss, m = clipped_value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1)
    )
    assert float(loss) == pytest.approx(0.32)
    assert float(m["vf_clipfrac"]) == 1.0


def test_vanilla_pg_matches_loop_hand_computed_and_its_gradient_is_reinforce():
    from tempering.algos import vanilla_pg_loss

    gen = torch.Generator().manual_seed(5)
    logp, old, adv = (torch.randn(3, 4, generator=gen) for _ in range(3))
    mask = torch.ones(3, 4)
    loss, _ = vanilla_pg_loss(LossInputs(logp, old, adv, mask))
    want = (
        sum(
            -a * math.exp(lp - o)
            for lr, orow, arow in zip(logp.tolist(), old.tolist(), adv.tolist())
            for lp, o, a in zip(lr, orow, arow)
        )
        / 12
    )
    assert float(loss) == pytest.approx(want, rel=1e-5)
    # At ratio 1 (on-policy) the gradient is -A * d log pi, REINFORCE's.
    x = torch.tensor([[0.3, -0.2]], requires_grad=True)
    loss, _ = vanilla_pg_loss(LossInputs(x, x.detach(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2)))
    loss.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-1.0, 0.5]]))


def test_clipped_value_loss_matches_loop_and_is_plain_mse_inside_the_clip():
    gen = torch.Generator().manual_seed(6)
    v, old, ret = (torch.randn(2, 5, generator=gen) for _ in range(3))
    mask = torch.ones(2, 5)
    loss, _ = clipped_value_loss(v, old, ret, mask, clip_range=0.3)
    want = []
    for vr, orow, rrow in zip(v.tolist(), old.tolist(), ret.tolist()):
        for a, o, r in zip(vr, orow, rrow):
            c = o + min(max(a - o, -0.3), 0.3)
            want.append(0.5 * max((a - r) ** 2, (c - r) ** 2))
    assert float(loss) == pytest.approx(sum(want) / len(want), rel=1e-5)
    same, _ = clipped_value_loss(old, old, ret, mask)
    assert float(same) == pytest.approx(float(0.5 * ((old - ret) ** 2).mean()), rel=1e-5)


# ------------------------------------------------------------------------------------------ GSPO, CISPO


def _inputs(seed=0, b=5, t=7, token_adv=False):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen)
    old = logp + 0.05 * torch.randn(b, t, generator=gen)
    adv = (
        torch.randn(b, 1, generator=gen).expand(b, t).clone()
        if not token_adv
        else torch.randn(b, t, generator=gen)
    )
    mask = (torch.rand(b, t, generator=gen) > 0.25).float()
    mask[:, 0] = 1.0
    return logp, old, adv, mask


def test_gspo_is_the_papers_sequence_objective_in_value_and_gradient():
    """The token form equals the paper's sequence objective, -1/G sum_i min(s_i A_i, clip(s_i) A_i) with
    s_i = exp(mean_t log ratio), in value and in its gradient with respect to every token's log-prob."""
    from tempering.algos import gspo_loss

    logp, old, adv, mask = _inputs()
    eps_low, eps_high = 0.01, 0.015  # some sequences clipped, some not
    mine = logp.clone().requires_grad_(True)
    loss, metrics = gspo_loss(
        LossInputs(mine, old, adv, mask),
        clip_ratio_low=eps_low,
        clip_ratio_high=eps_high,
        loss_agg="seq-mean-token-mean",
    )
    loss.backward()
    paper = logp.clone().requires_grad_(True)
    s = torch.exp(((paper - old) * mask).sum(1) / mask.sum(1))
    a = adv[:, 0]
    objective = torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a).mean()
    (-objective).backward()
    assert math.isclose(float(loss), float(-objective), rel_tol=1e-6)
    assert torch.allclose(mine.grad * mask, paper.grad * mask, atol=1e-7)
    clipped = ((s < 1 - eps_low) & (a < 0)) | ((s > 1 + eps_high) & (a > 0))
    assert 0 < int(clipped.sum()) < len(s)  # both cases are exercised
    assert torch.all(mine.grad[clipped] == 0) and torch.all(mine.grad[~clipped].abs().sum(1) > 0)
    assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0


def test_gspo_hand_computed_and_token_advantages():
    from tempering.algos import gspo_loss

    # One sequence of two tokens with ratios 2 and 0.5: s = sqrt(2 * 0.5) = 1, unclipped: loss = -A.
    logp = torch.log(torch.tensor([[2.0, 0.5]]))
    loss, _ = gspo_loss(
        LossInputs(logp, torch.zeros(1, 2), torch.full((1, 2), 3.0), torch.ones(1, 2)),
        clip_ratio=1e-3,
        loss_agg="seq-mean-token-mean",
    )
    assert math.isclose(float(loss), -3.0, rel_tol=1e-6)
    # GSPO-token: per-token advantages, one shared ratio s = e^0.1 (clipped to 1 + 0.05 for A > 0 tokens).
    logp = torch.tensor([[0.1, 0.1]])
    loss, _ = gspo_loss(
        LossInputs(logp, torch.zeros(1, 2), torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)),
        clip_ratio=0.05,
        loss_agg="seq-mean-token-mean",
    )
    s = math.exp(0.1)
    assert math.isclose(float(loss), (-1.05 * 1.0 + 2.0 * s) / 2, rel_tol=1e-6)


def test_cispo_hand_computed_and_its_clipped_tokens_keep_their_gradient():
    """Two tokens, A = +1: ratio 2 (above 1 + eps) and ratio 1.1 (inside). CISPO: loss = -mean(w_t A log pi),
    w = (1.2, 1.1) without gradient, so d loss / d log pi_t = -w_t A / 2 - nonzero also for the clipped token,
    where PPO-clip's is 0."""
    from tempering.algos import cispo_loss

    old = torch.log(torch.tensor([[0.2, 0.5]]))
    logp = (old + torch.log(torch.tensor([[2.0, 1.1]]))).requires_grad_(True)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    loss, metrics = cispo_loss(LossInputs(logp, old, adv, mask), clip_ratio=0.2)
    expected = -(1.2 * float(logp[0, 0]) + 1.1 * float(logp[0, 1])) / 2
    assert math.isclose(float(loss), expected, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.6, -0.55]]), atol=1e-6)
    assert math.isclose(float(metrics["pg_clipfrac"]), 0.5)
    ppo = logp.detach().clone().requires_grad_(True)
    ppo_clip_loss(LossInputs(ppo, old, adv, mask), clip_ratio=0.2)[0].backward()
    assert float(ppo.grad[0, 0]) == 0.0 and float(ppo.grad[0, 1]) != 0.0


def test_cispo_matches_the_papers_objective_on_random_values():
    """J = 1 / sum|o_i| sum_i sum_t sg(clip(r_i,t, 1 - eps_low, 1 + eps_high)) A_i,t log pi (token-mean):
    value and gradient, written out token by token; no lower bound with eps_low >= 1 (the paper's setting)."""
    from tempering.algos import cispo_loss

    logp, old, adv, mask = _inputs(seed=3, token_adv=True)
    old = logp + 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(4))
    mine = logp.clone().requires_grad_(True)
    loss, _ = cispo_loss(LossInputs(mine, old, adv, mask), clip_ratio_low=1.0, clip_ratio_high=0.28)
    loss.backward()
    total, grads, n = 0.0, torch.zeros_like(logp), float(mask.sum())
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                w = min(math.exp(float(logp[i, t] - old[i, t])), 1.28)
                total += w * float(adv[i, t]) * float(logp[i, t])
                grads[i, t] = -w * float(adv[i, t]) / n
    assert math.isclose(float(loss), -total / n, rel_tol=1e-5)
    assert torch.allclose(mine.grad, grads, atol=1e-6)


def test_gspo_and_cispo_are_in_the_registry():
    from tempering.algos import POLICY_LOSSES, cispo_loss, gspo_loss

    assert POLICY_LOSSES["gspo"] is gspo_loss and POLICY_LOSSES["cispo"] is cispo_loss
