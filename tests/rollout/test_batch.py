import torch

from tempering.algos.advantages import grpo_advantages
from tempering.rollout.batch import RolloutBatch


def make_batch(rewards):
    b = len(rewards)
    return RolloutBatch(
        prompt_ids=torch.arange(b * 3).view(b, 3),
        prompt_mask=torch.ones(b, 3, dtype=torch.long),
        response_ids=torch.arange(b * 2).view(b, 2),
        response_mask=torch.ones(b, 2),
        old_logprobs=torch.zeros(b, 2),
        rewards=torch.tensor(rewards),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )


def test_informative_drops_groups_whose_rewards_are_all_equal():
    batch = make_batch([1.0, 1.0, 0.0, 1.0])
    batch.advantages = grpo_advantages(batch.rewards, batch.group_ids)[:, None] * batch.response_mask
    kept = batch.informative()
    assert kept.group_ids.tolist() == [1, 1]
    assert torch.equal(kept.prompt_ids, batch.prompt_ids[2:])
    assert torch.equal(kept.advantages, batch.advantages[2:])


def test_informative_keeps_everything_when_nothing_is_informative():
    batch = make_batch([0.5, 0.5, 0.0, 0.0])
    batch.advantages = torch.zeros(4, 2)
    assert len(batch.informative()) == 4


def test_minibatches_hold_whole_groups_in_a_seeded_random_order():
    group_ids = torch.tensor([7, 7, 7, 2, 2, 2, 9, 9, 9, 4, 4, 4])  # ids as `informative` leaves them
    batch = RolloutBatch(
        torch.zeros(12, 1, dtype=torch.long),
        torch.ones(12, 1, dtype=torch.long),
        torch.zeros(12, 1, dtype=torch.long),
        torch.ones(12, 1),
        torch.zeros(12, 1),
        torch.zeros(12),
        group_ids,
    )
    orders = set()
    for seed in range(20):
        parts = batch.minibatches(2, torch.Generator().manual_seed(seed))
        assert len(parts) == 2 and sorted(torch.cat(parts).tolist()) == list(range(12))  # every row once
        assert all(
            len(p) == 6 and len(set(group_ids[p].tolist())) == 2 for p in parts
        )  # two whole groups each
        again = batch.minibatches(2, torch.Generator().manual_seed(seed))
        assert all(torch.equal(p, q) for p, q in zip(parts, again))
        orders.add(tuple(group_ids[torch.cat(parts)].unique_consecutive().tolist()))
    assert len(orders) > 10  # the groups' order is drawn (24 possible)
    odd = batch.minibatches(
        3, torch.Generator().manual_seed(0)
    )  # 4 groups into 3: rows stay grouped in order
    assert [len(p) for p in odd] == [4, 4, 4]
    assert group_ids[torch.cat(odd)].unique_consecutive().numel() == 4
