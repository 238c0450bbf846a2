"""The reasoning-gym adapter."""

import json

import pytest

pytest.importorskip("reasoning_gym")

from tempering.envs import EnvContext, make_env  # noqa: E402
from tempering.envs.gym import gym_datasets, gym_tasks, score_gym_answer  # noqa: E402
from tempering.types import Task  # noqa: E402


def test_more_than_a_hundred_task_families_are_available():
    assert len(gym_datasets()) >= 100 and "composite" not in gym_datasets()


def test_tasks_survive_a_task_file_and_score_with_their_verifier():
    names = ["basic_arithmetic", "game_of_life_halting", "arc_1d", "spell_backward", "list_functions"]
    train, heldout = gym_tasks(names, 3, 1, seed=0, max_prompt_chars=5000)
    assert {t.domain for t in train} == set(names)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    for task in train:
        task = Task.model_validate(json.loads(task.model_dump_json()))  # as read back from JSONL
        assert score_gym_answer(task, str(task.answer)) == 1.0, task.domain
        assert score_gym_answer(task, "zzz") == 0.0, task.domain  # game_of_life_halting's own verifier says 1.0


def test_generation_is_deterministic_even_for_global_random_users():
    a, _ = gym_tasks(["list_functions", "chain_sum"], 2, 1, seed=3, max_prompt_chars=5000)
    b, _ = gym_tasks(["list_functions", "chain_sum"], 2, 1, seed=3, max_prompt_chars=5000)
    assert [t.prompt for t in a] == [t.prompt for t in b]


def test_gym_env_scores_the_answer_and_allows_retries():
    [task], _ = gym_tasks(["basic_arithmetic"], 1, 0, seed=0)
    env = make_env(task, EnvContext(max_turns=2))
    env.reset(task)
    first = env.step("Answer: 123456789")
    assert not first.done and first.rewards == {"correct": 0.0} and "incorrect" in first.observation
    second = env.step(f"<answer>{task.answer}</answer>")
    assert second.done and second.info["success"]


def test_an_unknown_dataset_is_named():
    with pytest.raises(ValueError, match="nope"):
        gym_tasks(["nope"], 1, 1, seed=0)


def test_a_multi_line_answer_scores_in_full():
    [task], _ = gym_tasks(["rotate_matrix"], 1, 0, seed=0)
    assert "\n" in str(task.answer)
    env = make_env(task, EnvContext(max_turns=1))
    env.reset(task)
    assert env.step(str(task.answer)).rewards == {"correct": 1.0}
