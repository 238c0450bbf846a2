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
action's cache (`keep`), so the next turn computes only the new tokens (`Turn.computed`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from tempering.envs import EnvContext, Environment, make_env
from tempering.rollout.batch import RolloutBatch, concat_batches
from tempering.rollout.chat import Conversation, chat_format
from tempering.rollout.engine import Engine
from tempering.types import RewardResult, Task, Turn


@dataclass
class Episode:
    task: Task
    group_id: int
    env: Environment | None
    """None once `detach`ed."""
    prompt_ids: list[int]
    conversation: Conversation | None
    ids: list[int] = field(default_factory=list)
    """Every token after the prompt: actions and observations."""
    policy: list[bool] = field(default_factory=list)
    """True where `ids` holds a token the policy sampled."""
    logprobs: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    """Index in `ids` of the last token of each action."""
    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False
    """The context budget ended the episode."""
    done: bool = False
    stopped: str | None = None
    """Why the `stop` rule ended the episode early (None: it did not)."""
    version: int = 0
    """The policy version that sampled the episode's actions."""

    def detach(self) -> Episode:
        """The episode as plain data (no live environment, no conversation object): what crosses processes
        and goes into a checkpoint once it has been rewarded."""
        self.env = self.conversation = None
        return self

    @property
    def success(self) -> bool:
        return bool(self.turns and self.turns[-1].info.get("success"))

    @property
    def first_success(self) -> bool:
        return bool(self.turns and self.turns[0].info.get("success"))


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
    episodes = []
    for i in range(len(tasks) * group_size):
        task, index = tasks[i // group_size], first_task * group_size + i
        env = make_env(task, ctx, seed=seed * 100_003 + index)
        prompt_ids, conv = fmt.start(env.reset(task), tools=env.tool_schemas())
        episodes.append(Episode(task, index // group_size, env, prompt_ids, conv))
    active = list(episodes)
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="env") as pool:
        for turn in range(ctx.max_turns):
            rooms = [max_context - len(e.prompt_ids) - len(e.ids) for e in active]
            for e, room in zip(active, rooms):
                if room <= 0:
                    e.truncated = e.done = True
            running = [(e, room) for e, room in zip(active, rooms) if room > 0]
            if not running:
                break
            contexts = [e.prompt_ids + e.ids for e, _ in running]
            with timer("gen"):
                gen = engine.generate(contexts, generator=generator, greedy=greedy, keep=ctx.max_turns > 1,
                                      max_new_tokens=min(max_new_tokens, max(room for _, room in running)))
            actions = [(e, *_record_action(e, gen, row, room, engine, max_new_tokens))
                       for row, (e, room) in enumerate(running)]
            with timer("reward"):
                steps = _step_all([e.env for e, _, _, _ in actions], [text for _, text, _, _ in actions], pool)
            for row, ((e, text, ended, n), step) in enumerate(zip(actions, steps)):
                computed = len(contexts[row]) - (gen.reused[row] if gen.reused else 0)
                e.turns.append(Turn(text, None, dict(step.rewards), dict(step.info), ended=ended, tokens=n,
                                    computed=computed))
                e.version = gen.version
                last = step.done or turn == ctx.max_turns - 1 or e.truncated
                if not last and stop is not None:
                    e.stopped = stop(e)
                if last or e.stopped:
                    e.done = True
                    continue
                observation = e.turns[-1].observation = step.observation or ""
                obs_ids = fmt.observation(e.conversation, text, ended, observation)
                room = max_context - len(e.prompt_ids) - len(e.ids)
                if len(obs_ids) >= room:  # the budget is reached inside the observation
                    obs_ids, e.truncated, e.done = obs_ids[: max(0, room)], True, True
                e.ids += obs_ids
                e.policy += [False] * len(obs_ids)
                e.logprobs += [0.0] * len(obs_ids)
            active = [e for e in active if not e.done]
    engine.release()  # what was kept for a next turn is of no use now; its memory goes back
    return episodes


def _step_all(envs: list[Environment], actions: list[str], pool: ThreadPoolExecutor) -> list:
    """Each environment's step, batched per environment kind; in the order of `envs`."""
    steps: list = [None] * len(envs)
    kinds: dict[type, list[int]] = {}
    for i, env in enumerate(envs):
        kinds.setdefault(type(env), []).append(i)
    for cls, rows in kinds.items():
        for i, step in zip(rows, cls.step_batch([envs[i] for i in rows], [actions[i] for i in rows], pool)):
            steps[i] = step
    return steps


def _record_action(e: Episode, gen, row: int, room: int, engine: Engine, max_new_tokens: int,
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


@dataclass
class Rollout:
    """What `collect` returns: the scored episodes and the batch the trainer consumes."""

    episodes: list[Episode]
    rewards: list[RewardResult]
    batch: RolloutBatch
    metrics: dict[str, float] = field(default_factory=dict)
    """DAPO's dynamic-sampling counts, when it is on."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of its phases (`timing_s/gen`, `timing_s/reward`), wherever it ran."""


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    """One rollout of several (a round's shards, DAPO's rounds): episodes and rows in order, times summed."""
    timings: dict[str, float] = {}
    for p in parts:
        for k, v in p.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    return Rollout([e for p in parts for e in p.episodes], [x for p in parts for x in p.rewards],
                   concat_batches([p.batch for p in parts]), {k: v for p in parts for k, v in p.metrics.items()}, timings)
