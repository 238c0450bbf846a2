"""The asynchronous schedule and shards (`distributed.schedule`), and shard rollouts put back together."""

import torch

from tempering.distributed.schedule import behaviour_version, shard_specs, staleness_metrics
from tempering.rollout.batch import RolloutBatch, concat_batches
from tempering.seeding import step_seed
from tempering.types import Task


def tasks(n):
    return [Task(id=f"t{i}", domain="d", prompt="p", env="answer", answer=i) for i in range(n)]


def test_behaviour_versions_lag_by_k():
    assert [behaviour_version(s, 0) for s in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [behaviour_version(s, 1) for s in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [behaviour_version(s, 3) for s in range(1, 7)] == [0, 0, 0, 0, 1, 2]


def test_staleness_is_min_k_and_step_minus_one():
    for k in (0, 1, 3):
        lags = [
            staleness_metrics(s, torch.tensor([behaviour_version(s, k)] * 4))["async/staleness/max"]
            for s in range(1, 7)
        ]
        assert lags == [min(k, s - 1) for s in range(1, 7)]


def test_one_shard_keeps_the_synchronous_seeds_and_every_task():
    (spec,) = shard_specs(5, 0, tasks(4), 1, seed=3, version=4)
    assert spec.generator_seed == step_seed(3, 5, 0) and spec.env_seed == step_seed(3, 5, 4)
    assert [t.id for t in spec.tasks] == ["t0", "t1", "t2", "t3"] and spec.first_task == 0
    (later,) = shard_specs(5, 2, tasks(4), 1, seed=3, version=4)
    assert later.generator_seed == step_seed(3, 5, 12) and later.env_seed == step_seed(3, 5, 6)


def test_shards_cut_the_tasks_in_order_with_their_own_streams():
    specs = shard_specs(2, 0, tasks(7), 3, seed=0, version=1)
    assert [[t.id for t in s.tasks] for s in specs] == [["t0", "t1"], ["t2", "t3"], ["t4", "t5", "t6"]]
    assert [s.first_task for s in specs] == [0, 2, 4]
    assert len({s.generator_seed for s in specs}) == 3 and len({s.env_seed for s in specs}) == 1
    assert [s.key for s in specs] == [(2, 0, 0), (2, 0, 1), (2, 0, 2)]


def test_concatenated_shards_fill_token_rewards_a_shard_lacks():
    def part(width, token_rewards):
        b = 2
        return RolloutBatch(
            prompt_ids=torch.ones(b, 3, dtype=torch.long),
            prompt_mask=torch.ones(b, 3),
            response_ids=torch.ones(b, width, dtype=torch.long),
            response_mask=torch.ones(b, width),
            old_logprobs=torch.zeros(b, width),
            rewards=torch.zeros(b),
            group_ids=torch.zeros(b, dtype=torch.long),
            token_rewards=token_rewards,
        )

    both = concat_batches([part(2, None), part(3, torch.full((2, 3), 0.5))])
    assert both.token_rewards.tolist() == [[0.0] * 3, [0.0] * 3, [0.5] * 3, [0.5] * 3]
    assert concat_batches([part(2, None), part(3, None)]).token_rewards is None
