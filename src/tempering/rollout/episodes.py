"""The multi-turn rollout driver: the policy acts, the environment answers, up to `max_turns`.

All episodes of a batch advance together: each turn is one batched generation over the episodes still
running (the contexts differ in length; they are left-padded), then every environment steps on its
action (in parallel threads: code environments wait on the sandbox). An episode is one token sequence
after its prompt - action, observation, action, ... - in which only the actions' tokens are the
policy's: `collate_episodes` sets `response_mask` on them alone, so observation tokens are attended to
but never trained on. When the context budget (`max_context` tokens, prompt included) is reached the
episode ends and is marked truncated.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tempering.envs import EnvContext, Environment, make_env
from tempering.rollout.batch import RolloutBatch
from tempering.rollout.chat import Conversation, chat_format
from tempering.rollout.generate import generate, left_pad
from tempering.types import RewardResult, Task


@dataclass
class Turn:
    action: str
    observation: str | None
    """What came back (None when the episode ended with this action)."""
    rewards: dict[str, float]
    info: dict[str, Any]


@dataclass
class Episode:
    task: Task
    group_id: int
    env: Environment
    prompt_ids: list[int]
    conversation: Conversation
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

    @property
    def success(self) -> bool:
        return bool(self.turns and self.turns[-1].info.get("success"))

    @property
    def first_success(self) -> bool:
        return bool(self.turns and self.turns[0].info.get("success"))


def run_episodes(
    model,
    tokenizer,
    tasks: list[Task],
    ctx: EnvContext,
    *,
    group_size: int,
    max_new_tokens: int,
    max_context: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    seed: int = 0,
    chat: str = "auto",
    engine=generate,
) -> list[Episode]:
    """`group_size` episodes per task (consecutive), each up to `ctx.max_turns` turns. `engine` is the
    generation function (`tempering.rollout.generate.generate`'s signature)."""
    fmt = chat_format(tokenizer, chat)
    episodes = []
    for i in range(len(tasks) * group_size):
        task = tasks[i // group_size]
        env = make_env(task, ctx, seed=seed * 100_003 + i)
        prompt_ids, conv = fmt.start(env.reset(task), tools=env.tool_schemas())
        episodes.append(Episode(task, i // group_size, env, prompt_ids, conv))
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
            gen = engine(model, tokenizer, [e.prompt_ids + e.ids for e, _ in running],
                         max_new_tokens=min(max_new_tokens, max(room for _, room in running)),
                         temperature=temperature, top_p=top_p, greedy=greedy, generator=generator)
            actions = [(e, *_record_action(e, gen, row, room, tokenizer, max_new_tokens))
                       for row, (e, room) in enumerate(running)]
            steps = list(pool.map(lambda a: a[0].env.step(a[1]), actions))
            for (e, text, ended), step in zip(actions, steps):
                last = step.done or turn == ctx.max_turns - 1 or e.truncated
                observation = None if last else (step.observation or "")
                e.turns.append(Turn(text, observation, dict(step.rewards), dict(step.info)))
                if last:
                    e.done = True
                    continue
                obs_ids = fmt.observation(e.conversation, text, ended, observation)
                room = max_context - len(e.prompt_ids) - len(e.ids)
                if len(obs_ids) >= room:  # the budget is reached inside the observation
                    obs_ids, e.truncated, e.done = obs_ids[: max(0, room)], True, True
                e.ids += obs_ids
                e.policy += [False] * len(obs_ids)
                e.logprobs += [0.0] * len(obs_ids)
            active = [e for e in active if not e.done]
    return episodes


def _record_action(e: Episode, gen, row: int, room: int, tokenizer, max_new_tokens: int) -> tuple[str, bool]:
    """Append row `row` of a generation to episode `e` (cut to the `room` left in its context budget);
    -> (the action's text, whether it ended with EOS)."""
    n = min(int(gen.response_mask[row].sum()), room)
    ids = gen.response_ids[row, :n].tolist()
    ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
    e.truncated = n == room and not ended and room < max_new_tokens
    e.ids += ids
    e.policy += [True] * n
    e.logprobs += gen.logprobs[row, :n].tolist()
    e.turn_ends.append(len(e.ids) - 1)
    return tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False), ended


# ------------------------------------------------------------------------------------------ rewards


def episode_rewards(episodes: list[Episode], weights: dict[str, float] | None = None,
                    step_fn: Callable[..., list[float]] | None = None) -> list[RewardResult]:
    """Each episode's outcome (its environment's `outcome` components, from the final step) and process
    rewards (every other component, per turn). Weights: `weights`, else the environment's defaults.
    `step_fn(task, [action of each turn]) -> one score per turn` (`reward.step_fn`) adds a process reward
    per turn, logged as the component `step`."""
    out = []
    for e in episodes:
        w = {**type(e.env).default_weights, **(weights or {})}
        outcome_names = type(e.env).outcome
        final = e.turns[-1].rewards if e.turns else {}
        components = {name: float(final.get(name, 0.0)) for name in outcome_names}
        per_turn = []
        for t in e.turns:
            process = {k: v for k, v in t.rewards.items() if k not in outcome_names}
            per_turn.append(sum(w.get(k, 0.0) * v for k, v in process.items()))
            for k, v in process.items():
                components[k] = components.get(k, 0.0) + float(v)
        if step_fn is not None and e.turns:
            scores = [float(x) for x in step_fn(e.task, [t.action for t in e.turns])]
            if len(scores) != len(e.turns):
                raise ValueError(f"step reward function returned {len(scores)} scores for {len(e.turns)} turns")
            per_turn = [p + x for p, x in zip(per_turn, scores)]
            components["step"] = sum(scores)
        outcome = sum(w.get(name, 0.0) * components[name] for name in outcome_names)
        out.append(RewardResult(score=outcome + sum(per_turn), components=components,
                                info={"outcome": outcome, "turn_rewards": per_turn}))
    return out


def collate_episodes(episodes: list[Episode], rewards: list[RewardResult], pad_id: int,
                     group_offset: int = 0) -> RolloutBatch:
    """Episodes -> a RolloutBatch: the outcome as the sequence reward, process rewards at the last token of
    the turn that earned them, observation tokens attended to (`response_attention`) but not trained on."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id)
    width = max(1, max(len(e.ids) for e in episodes))
    b = len(episodes)
    response_ids = torch.full((b, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, width))
    attention = torch.zeros((b, width))
    old_logprobs = torch.zeros((b, width))
    token_rewards = torch.zeros((b, width))
    for i, (e, r) in enumerate(zip(episodes, rewards)):
        n = len(e.ids)
        if n:
            response_ids[i, :n] = torch.tensor(e.ids)
            response_mask[i, :n] = torch.tensor(e.policy, dtype=torch.float32)
            attention[i, :n] = 1.0
            old_logprobs[i, :n] = torch.tensor(e.logprobs)
        for end, value in zip(e.turn_ends, r.info["turn_rewards"]):
            token_rewards[i, end] += value
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        old_logprobs=old_logprobs, rewards=torch.tensor([r.info["outcome"] for r in rewards]),
        group_ids=torch.tensor([e.group_id + group_offset for e in episodes]),
        token_rewards=token_rewards if token_rewards.any() else None, response_attention=attention,
    )

