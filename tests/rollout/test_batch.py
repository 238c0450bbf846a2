import torch

from tempering.algos.advantages import grpo_advantages
from tempering.rollout.batch import RolloutBatch


def make_batch(rewards):
    b = len(rewards)
    return RolloutBatch(
        prompt_ids=torch.arange(b * 3).view(b, 3), prompt_mask=torch.ones(b, 3, dtype=torch.long),
        response_ids=torch.arange(b * 2).view(b, 2), response_mask=torch.ones(b, 2),
        old_logprobs=torch.zeros(b, 2), rewards=torch.tensor(rewards), group_ids=torch.tensor([0, 0, 1, 1]),
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
