"""A real rollout batch of a tiny model, for training tests."""

from __future__ import annotations

import torch

from tempering.algos import AdvantageInputs, grpo
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.inference.generation import encode_prompt
from tempering.rollout.batch import RolloutBatch


def make_batch(model, tokenizer, tasks, rewards):
    prompts = [encode_prompt(tokenizer, t.prompt) for t in tasks for _ in range(2)]
    gen = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=6)).generate(
        prompts, generator=torch.Generator().manual_seed(0)
    )
    batch = RolloutBatch(
        gen.prompt_ids,
        gen.prompt_mask,
        gen.response_ids,
        gen.response_mask,
        gen.logprobs,
        torch.tensor(rewards),
        torch.arange(len(prompts)) // 2,
    )
    batch.advantages, batch.returns = grpo(
        AdvantageInputs(batch.rewards, batch.response_mask, batch.group_ids)
    )
    return batch
