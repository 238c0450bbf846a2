"""Reference guidance (`algo.guidance: reference`): a group whose every sample failed gets the task's
reference solution in place of its last sample, so the group has a success to learn from.

Off-policy guidance as LUFFY (Yan et al. 2025, "Learning to Reason under Off-Policy Guidance") mixes
demonstrations into GRPO's groups. Without it a group of failures carries no gradient: on the default
recipe half the groups of the last RL steps failed in every sample, and whole families of functions the
SFT model half knew fell to 0% (the policy had settled on another family with the same signature and
never sampled this one again). The reference row goes through the same driver as a sampled one (a
`ReplayEngine` "samples" the reference's tokens, the environment runs its tests, the reward function
scores it), and its log-probs are the policy's own for those tokens (the PPO ratio starts at 1), so the
update treats it as a sample the policy drew: a positive advantage in a group of failures pulls the policy
toward it. Only single-turn tasks with a reference short enough for `rollout.max_new_tokens` are guided;
the reference's text is the one SFT trains on (`data.tasks.sft_completion`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from tempering.data.tasks import sft_completion
from tempering.envs import EnvContext
from tempering.inference.chat import chat_format
from tempering.inference.generation import Generation, generation_of
from tempering.rollout.episodes import run_episodes
from tempering.types import Episode, Task


class ReplayEngine:
    """An engine whose "samples" are given completions (one per context, in order), with the log-probs the
    wrapped engine's policy gives them at its sampling temperature."""

    def __init__(self, engine, completions: list[list[int]]):
        self.engine, self.completions = engine, completions
        self.tokenizer, self.sampling, self.stop_ids = engine.tokenizer, engine.sampling, engine.stop_ids
        self.version = engine.version

    def generate(
        self,
        contexts: list[list[int]],
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        keep: bool = False,
    ) -> Generation:
        """The completions (the sampling arguments do not apply), with the policy's log-probs."""
        assert len(contexts) == len(self.completions), "one completion per context"
        gen = generation_of(
            self.tokenizer, contexts, self.completions, None, set(self.stop_ids), self.version
        )
        logprobs = self.logprobs(gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
        gen.logprobs = logprobs * gen.response_mask
        return gen

    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_attention: Tensor
    ) -> Tensor:
        return self.engine.logprobs(prompt_ids, prompt_mask, response_ids, response_attention)

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        raise TypeError("a ReplayEngine replays given completions; it has no weights of its own")

    def release(self) -> None:
        """Nothing kept: the wrapped engine's caches are its own."""


def reference_ids(task: Task, tokenizer, end_id: int, budget: int) -> list[int] | None:
    """The reference's completion as the policy would write it (its end token last), or None when the task
    has none or it does not fit `budget` tokens."""
    if not task.reference_solution:
        return None
    ids = tokenizer(sft_completion(task), add_special_tokens=False).input_ids + [end_id]
    return ids if len(ids) <= budget else None


def guide_failed_groups(
    engine, episodes: list[Episode], ctx: EnvContext, *, group_size: int, max_context: int, chat: str
) -> tuple[list[Episode], int]:
    """`episodes` (groups of `group_size`, consecutive) with the last episode of each all-failed group
    replaced by its task's reference, run through the environment; -> (episodes, groups guided)."""
    if ctx.max_turns != 1 or ctx.agent is not None:
        return episodes, 0
    end_id = chat_format(engine.tokenizer, chat).end_id
    budget = engine.sampling.max_new_tokens
    places, tasks, completions = [], [], []
    for start in range(0, len(episodes), group_size):
        group = episodes[start : start + group_size]
        if any(e.success for e in group):
            continue
        ids = reference_ids(group[-1].task, engine.tokenizer, end_id, budget)
        if ids is not None and len(group[-1].prompt_ids) + len(ids) <= max_context:
            places.append(start + group_size - 1)
            tasks.append(group[-1].task)
            completions.append(ids)
    if not places:
        return episodes, 0
    guided = run_episodes(
        ReplayEngine(engine, completions), tasks, ctx, group_size=1, max_context=max_context, chat=chat
    )
    out = list(episodes)
    for place, episode in zip(places, guided):
        episode.group_id = episodes[place].group_id
        out[place] = episode
    return out, len(places)
