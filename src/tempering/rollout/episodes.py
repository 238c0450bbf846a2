"""The rollout driver - the one path from tasks to scored episodes: the policy acts, the environment
answers, up to `max_turns`. A single-turn code task is a one-turn episode of the code environment.

All episodes of a batch advance together: each turn is one batched generation over the episodes still
running (the contexts differ in length; they are left-padded; the first turn of a group shares its
prompt's prefill), then the environments step on their actions, a batch per environment kind
(`Environment.step_batch`: the code environment sends all programs to the sandbox at once, each distinct
one once). An episode is one token sequence after its prompt - action, observation, action, ... - in
which only the actions' tokens are the policy's: `collate` sets `response_mask` on them alone, so
observation tokens are attended to but never trained on. When the context budget (`max_context` tokens,
prompt included) is reached the episode ends and is marked truncated. A `stop` rule may end an episode
early (the repair agent's: stuck on the same error). With several turns the engine keeps each finished
action's cache (`keep`), so the next turn computes only the new tokens (`Turn.computed`). The driver keeps
each episode's environment and conversation to itself (`_Live`) and returns plain records (`types.Episode`).
When the run names an agent of the user's (`agent.entry`), the agent acts instead: its runs are recorded
through a proxy and come back as the same records (`agent.episodes.sample_episodes`, which the rollout
source and evaluation call: it hands every other run to this driver).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from tempering.envs import EnvContext, Environment, make_env, step_all
from tempering.inference.chat import Conversation, chat_format
from tempering.inference.engine import Engine
from tempering.types import Episode, Task


@dataclass
class _Live:
    """The driver's live state of one running episode, beside its record (which never holds it)."""

    episode: Episode
    env: Environment
    conversation: Conversation


def run_episodes(
    engine: Engine,
    tasks: list[Task],
    ctx: EnvContext,
    *,
    group_size: int,
    max_context: int,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    seed: int = 0,
    chat: str = "auto",
    timer: Callable[[str], AbstractContextManager] | None = None,
    stop: Callable[[Episode], str | None] | None = None,
    first_task: int = 0,
) -> list[Episode]:
    """`group_size` episodes per task (consecutive), each up to `ctx.max_turns` turns, sampled by `engine`.
    `timer(name)` (optional) times the phases: `gen` (generation) and `reward` (environment steps).
    `stop(episode)`, asked after each turn that did not end the episode, may end it with a reason.
    `first_task`: the index of `tasks[0]` in its whole round (a shard's): group ids and environment seeds are
    the round's."""
    timer = timer or (lambda name: nullcontext())
    tokenizer, max_new_tokens = engine.tokenizer, engine.sampling.max_new_tokens
    fmt = chat_format(tokenizer, chat)
    assert ctx.agent is None, "a run of the user's agent: agent.episodes.sample_episodes drives it"
    lives = [
        _start(tasks[i // group_size], ctx, fmt, seed, first_task * group_size + i, group_size)
        for i in range(len(tasks) * group_size)
    ]
    active = list(lives)
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="env") as pool:
        for turn in range(ctx.max_turns):
            rooms = [max_context - len(x.episode.prompt_ids) - len(x.episode.ids) for x in active]
            for x, room in zip(active, rooms):
                if room <= 0:
                    x.episode.truncated = x.episode.done = True
            running = [(x, room) for x, room in zip(active, rooms) if room > 0]
            if not running:
                break
            contexts = [x.episode.prompt_ids + x.episode.ids for x, _ in running]
            with timer("gen"):
                gen = engine.generate(
                    contexts,
                    generator=generator,
                    greedy=greedy,
                    keep=ctx.max_turns > 1,
                    max_new_tokens=min(max_new_tokens, max(room for _, room in running)),
                )
            actions = [
                (x, *_record_action(x.episode, gen, row, room, engine, max_new_tokens))
                for row, (x, room) in enumerate(running)
            ]
            with timer("reward"):
                steps = step_all([x.env for x, _, _, _ in actions], [text for _, text, _, _ in actions], pool)
            for row, ((x, text, ended, n), step) in enumerate(zip(actions, steps)):
                computed = len(contexts[row]) - (gen.reused[row] if gen.reused else 0)
                x.episode.turns.append(step.as_turn(text, ended=ended, tokens=n, computed=computed))
                x.episode.version = gen.version
                last = step.done or turn == ctx.max_turns - 1 or x.episode.truncated
                _after_step(x, step, text, ended, last, stop, fmt, max_context)
            active = [x for x in active if not x.episode.done]
    engine.release()  # what was kept for a next turn is of no use now; its memory goes back
    return [x.episode for x in lives]


def _start(task: Task, ctx: EnvContext, fmt, seed: int, index: int, group_size: int) -> _Live:
    """Episode `index` of its round: its environment (seeded by the index), reset on `task`, and its prompt."""
    env = make_env(task, ctx, seed=seed * 100_003 + index, group_id=index // group_size)
    prompt_ids, conversation = fmt.start(env.reset(task), tools=env.tool_schemas())
    episode = Episode(
        task, env.group_id, prompt_ids, dict(type(env).default_weights), frozenset(type(env).outcome)
    )
    return _Live(episode, env, conversation)


def _after_step(x: _Live, step, text: str, ended: bool, last: bool, stop, fmt, max_context: int) -> None:
    """End the episode (its `last` turn, or the `stop` rule), or append the observation's tokens."""
    e = x.episode
    if not last and stop is not None:
        e.stopped = stop(e)
    if last or e.stopped:
        e.done = True
        return
    observation = e.turns[-1].observation = step.observation or ""
    obs_ids = fmt.observation(x.conversation, text, ended, observation)
    room = max_context - len(e.prompt_ids) - len(e.ids)
    if len(obs_ids) >= room:  # the budget is reached inside the observation
        obs_ids, e.truncated, e.done = obs_ids[: max(0, room)], True, True
    e.ids += obs_ids
    e.policy += [False] * len(obs_ids)
    e.logprobs += [0.0] * len(obs_ids)


def _record_action(
    e: Episode, gen, row: int, room: int, engine: Engine, max_new_tokens: int
) -> tuple[str, bool, int]:
    """Append row `row` of a generation to episode `e` (cut to the `room` left in its context budget);
    -> (the action's text, whether it ended with a stop token, its number of tokens)."""
    n = min(int(gen.response_mask[row].sum()), room)
    ids = gen.response_ids[row, :n].tolist()
    ended = bool(ids) and ids[-1] in engine.stop_ids
    e.truncated = n == room and not ended and room < max_new_tokens
    e.ids += ids
    e.policy += [True] * n
    e.logprobs += gen.logprobs[row, :n].tolist()
    e.turn_ends.append(len(e.ids) - 1)
    return engine.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False), ended, n
