"""Data-parallel updates, ranks as threads of this process over a real gloo group on loopback: M replicas
that each run their part of every minibatch take the single trainer's step (up to float summation order)
and end bit-identical to each other - for every loss aggregation, with the critic, with more ranks than a
minibatch has rows; and a rank that goes its own way is caught."""

import copy
import functools
import threading

import pytest
import torch

from tempering.algos import ppo_clip_loss
from tempering.distributed.weights import fingerprints
from tempering.training.critic import Critic, update_critic
from tempering.training.data_parallel import DataParallel, Rendezvous
from tempering.training.update import UpdateSettings, update_policy
from tests.helpers.batches import make_batch


def ranks(size, tmp_path, fn):
    """Run fn(rank, dp) for every rank in its own thread; their results in rank order."""
    rendezvous = Rendezvous(size, path=str(tmp_path / "rendezvous"), timeout_s=60)
    out, errors = [None] * size, []

    def one(rank):
        dp = DataParallel(rank, rendezvous)
        try:
            out[rank] = fn(rank, dp)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
        finally:
            dp.close()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def train(model, batch, dp=None, lr=0.5, loss_agg="token-mean"):
    """Plain SGD: the weights move by the gradients themselves (Adam would magnify float noise on
    near-zero gradients), so they tell whether the ranks' summed gradient is the single trainer's."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = functools.partial(ppo_clip_loss, loss_agg=loss_agg, norm_length=batch.response_ids.shape[1])
    settings = UpdateSettings(epochs=2, minibatches=2, loss_agg=loss_agg, entropy_coef=0.01)
    metrics = update_policy(model, opt, batch, loss, settings, torch.Generator().manual_seed(0), dp=dp)
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close_to_one_trainer(results, reference):
    (ref_metrics, ref_weights), rank0 = reference, results[0]
    for metrics, weights in results[1:]:  # every rank holds the same bits
        assert all(torch.equal(weights[n], rank0[1][n]) for n in weights)
        assert metrics == rank0[0]
    assert rank0[0].keys() == ref_metrics.keys()
    for k, v in ref_metrics.items():
        assert rank0[0][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    moved = max(float((rank0[1][n] - w).abs().max()) for n, w in ref_weights.items())
    assert moved < 1e-6


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_two_ranks_take_the_single_trainers_step(tiny, tasks, tmp_path, loss_agg):
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:4], [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    start = copy.deepcopy(model)
    reference = train(model, batch, loss_agg=loss_agg)
    assert (
        max(float((reference[1][n] - p).abs().max()) for n, p in start.named_parameters()) > 1e-3
    )  # it trained
    results = ranks(2, tmp_path, lambda rank, dp: train(copy.deepcopy(start), batch, dp, loss_agg=loss_agg))
    assert_close_to_one_trainer(results, reference)


def test_a_ranks_share_counts_the_loss_tokens_and_the_rows_that_have_one():
    from tempering.training.data_parallel import shares

    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])  # row 1: every token rejected
    tok, seq = shares(mask, torch.arange(4), torch.tensor([0, 1]), True)
    assert (tok, seq) == (2 / 5, 1 / 3)  # the seq-means count 3 rows, not 4
    assert shares(mask, torch.arange(4), torch.tensor([2, 3]), True) == (3 / 5, 2 / 3)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_two_ranks_take_the_single_trainers_step_with_rejected_tokens(tiny, tasks, tmp_path, loss_agg):
    """MIS took tokens, and one whole row, out of the loss mask: the ranks' shares count what is left."""
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:4], [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    batch.kept_mask = batch.response_mask.clone()
    batch.kept_mask[0] = 0.0
    batch.kept_mask[5, :2] = 0.0
    start = copy.deepcopy(model)
    reference = train(model, batch, loss_agg=loss_agg)
    results = ranks(2, tmp_path, lambda rank, dp: train(copy.deepcopy(start), batch, dp, loss_agg=loss_agg))
    assert_close_to_one_trainer(results, reference)


def test_more_ranks_than_rows_in_a_minibatch(tiny, tasks, tmp_path):
    """3 ranks, minibatches of 2 rows: one rank has nothing of its own in each and only takes part."""
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:2], [1.0, 0.0, 0.0, 1.0])
    start = copy.deepcopy(model)
    reference = train(model, batch)
    results = ranks(3, tmp_path, lambda rank, dp: train(copy.deepcopy(start), batch, dp))
    assert_close_to_one_trainer(results, reference)


def test_two_ranks_train_the_critic_as_one(tiny, tasks, tmp_path):
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:4], [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    batch.values = torch.zeros_like(batch.old_logprobs)
    critic = Critic(copy.deepcopy(model.model))

    def fit(c, dp=None):
        opt = torch.optim.SGD(c.parameters(), lr=0.1)
        metrics = update_critic(
            c, opt, batch, generator=torch.Generator().manual_seed(0), epochs=2, minibatches=2, dp=dp
        )
        return metrics, {n: p.detach().clone() for n, p in c.named_parameters()}

    results = ranks(2, tmp_path, lambda rank, dp: fit(copy.deepcopy(critic), dp))
    assert_close_to_one_trainer(results, fit(copy.deepcopy(critic)))


def test_a_rank_that_goes_its_own_way_is_caught(tiny, tasks, tmp_path):
    """Rank 1 steps with another learning rate (a replica whose schedule was not synced): the gradients are
    still all-reduced, but the weights part, and their fingerprints name the first tensor that differs."""
    from tempering.distributed.canary import WeightSyncError, compare_replicas

    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:2], [1.0, 0.0, 0.0, 1.0])
    start = copy.deepcopy(model)

    def one(rank, dp):
        m = copy.deepcopy(start)
        train(m, batch, dp, lr=0.5 if rank == 0 else 0.6)
        return fingerprints(m)

    prints = ranks(2, tmp_path, one)
    first = next(iter(prints[0]))
    with pytest.raises(
        WeightSyncError, match=f"trainer rank 1 .* at step 3.*first differing tensor: {first}"
    ):
        compare_replicas(prints[0], {1: prints[1]}, step=3)
