"""Reference guidance: groups whose samples all failed get the task's reference as their last sample."""

from __future__ import annotations

import pytest
import torch

from tempering.config import load_config
from tempering.data.tasks import sft_completion
from tempering.envs import EnvContext
from tempering.errors import ConfigError
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.models.forward import response_logprobs
from tempering.rewards import RewardFunction
from tempering.rollout.batch import collate
from tempering.rollout.episodes import run_episodes
from tempering.rollout.guidance import guide_failed_groups
from tests.helpers.engines import ScriptedEngine
from tests.helpers.runs import ROOT, metrics, stable, train_tiny


def scripted_groups(tokenizer, tasks, sandbox, group_size):
    """Group 0: its second sample is the reference (a success); every other sample is a wrong body."""
    calls = iter(range(10_000))

    def script(turn, text):
        i = next(calls)
        return sft_completion(tasks[0]).rstrip("\n") if i == 1 else "    return None"

    ctx = EnvContext(sandbox, max_turns=1)
    episodes = run_episodes(
        ScriptedEngine(tokenizer, script), tasks, ctx, group_size=group_size, max_context=256
    )
    return episodes, ctx


def test_only_all_failed_groups_get_the_reference_with_the_policys_logprobs(tiny, tasks, sandbox):
    model, tokenizer = tiny
    picked = tasks[0][:3]
    episodes, ctx = scripted_groups(tokenizer, picked, sandbox, group_size=3)
    assert [e.success for e in episodes] == [False, True, False] + [False] * 6
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=48, temperature=0.7))

    out, guided = guide_failed_groups(engine, episodes, ctx, group_size=3, max_context=256, chat="auto")

    assert guided == 2
    assert out[:3] == episodes[:3]  # the group with a success is left as it was
    for place in (5, 8):
        e, task = out[place], picked[place // 3]
        assert e.success and e.group_id == episodes[place].group_id == place // 3
        assert e.task is task and e.prompt_ids == episodes[place].prompt_ids
        want = tokenizer(sft_completion(task), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        assert e.ids == want and all(e.policy)
        # pi_old of the reference row: the policy's own log-probs at the sampling temperature
        prompt = torch.tensor([e.prompt_ids])
        expected, _ = response_logprobs(
            model, prompt, torch.ones_like(prompt), torch.tensor([want]), torch.ones(1, len(want)),
            temperature=0.7,
        )  # fmt: skip
        assert torch.allclose(torch.tensor(e.logprobs), expected[0], atol=1e-5)
    assert out[3:5] == episodes[3:5] and out[6:8] == episodes[6:8]

    rewards = RewardFunction({"tests": 1.0}).score(out)
    batch = collate(out, rewards, tokenizer)
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_a_reference_longer_than_the_token_budget_is_not_put_in(tiny, tasks, sandbox):
    model, tokenizer = tiny
    episodes, ctx = scripted_groups(tokenizer, tasks[0][1:3], sandbox, group_size=2)
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=2))
    out, guided = guide_failed_groups(engine, episodes, ctx, group_size=2, max_context=256, chat="auto")
    assert guided == 0 and out == episodes


def test_guidance_outside_single_turn_episodes_is_refused():
    with pytest.raises(ConfigError, match="algo.guidance: 'reference'.*env.max_turns is 3"):
        load_config(ROOT / "configs/smoke.yaml", ["algo.guidance=reference", "env.max_turns=3"])


def test_a_guided_run_counts_its_guided_groups_and_resumes_exactly(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train_tiny(whole, "train.steps=3", "algo.guidance=reference")
    rows = metrics(whole)
    assert all("train/guided_groups" in r for r in rows)
    assert sum(r["train/guided_groups"] for r in rows) > 0  # an untrained model fails whole groups
    train_tiny(cut, "train.steps=2", "algo.guidance=reference")
    train_tiny(cut, "train.steps=3", "algo.guidance=reference")
    assert stable(metrics(cut)) == stable(rows)
