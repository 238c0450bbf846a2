"""The multi-turn driver: masks, observations, budgets, per-turn rewards, chat formats."""

from __future__ import annotations

import pickle

import torch

from tempering.algos import LOSS_AGGREGATIONS, POLICY_LOSSES, LossInputs, masked_mean
from tempering.envs import EnvContext, Environment, make_env
from tempering.envs.tool_calls import format_answer, format_call
from tempering.envs.tool_tasks import generate_tool_tasks
from tempering.inference.chat import Conversation
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.models.forward import response_logprobs
from tempering.rewards import RewardFunction
from tempering.rollout.batch import collate
from tempering.rollout.episodes import run_episodes
from tempering.types import Episode
from tests.helpers.engines import ScriptedEngine


def episode_rewards(episodes, step_fn=None):
    """Each environment's own weights (reward.weights unset)."""
    return RewardFunction(step_fn=step_fn).score(episodes)


def tool_tasks(domain):
    train, _ = generate_tool_tasks(60, 0, seed=3)
    return [t for t in train if t.domain == domain]


def test_observation_tokens_get_exactly_zero_gradient(tiny, tasks, sandbox):
    model, tokenizer = tiny
    ctx = EnvContext(sandbox, max_turns=3)
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=12))
    episodes = run_episodes(
        engine, tasks[0][:3], ctx, group_size=2, max_context=190, generator=torch.Generator().manual_seed(0)
    )
    batch = collate(episodes, episode_rewards(episodes), tokenizer)
    observation = (batch.response_attention == 1) & (batch.response_mask == 0)
    assert observation.any() and batch.response_mask.any()

    def parameter_grads(junk: float, loss_agg: str):
        """Gradients of the full actor loss, with `junk` written into every observation position of the
        advantages, old log-probs and reference log-probs."""
        model.zero_grad()
        adv = torch.linspace(-1, 1, batch.response_mask.numel()).view_as(batch.response_mask)
        adv = torch.where(observation, junk, adv)
        old = torch.where(observation, junk, batch.old_logprobs)
        logprobs, entropy = response_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.attention, with_entropy=True
        )
        logprobs.retain_grad()
        mask = batch.response_mask
        pg, _ = POLICY_LOSSES["ppo_clip"](
            LossInputs(logprobs, old, adv, mask), loss_agg=loss_agg, norm_length=12
        )
        kl = masked_mean((logprobs - torch.where(observation, junk, old)) ** 2, mask)
        (pg - 0.01 * masked_mean(entropy, mask) + 0.1 * kl).backward()
        return logprobs.grad, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for loss_agg in LOSS_AGGREGATIONS:
        token_grad, grads = parameter_grads(0.0, loss_agg)
        assert (token_grad[observation] == 0).all()
        assert token_grad[batch.response_mask.bool()].abs().sum() > 0
        _, junk_grads = parameter_grads(123.0, loss_agg)
        assert all(torch.equal(a, b) for a, b in zip(grads, junk_grads)), loss_agg


def test_a_malformed_tool_call_becomes_an_observation_and_the_episode_goes_on(tiny):
    model, tokenizer = tiny
    task = tool_tasks("tool_calc")[0]
    expression = task.metadata["reference"][0]
    script = [
        "<tool_call>{not json</tool_call>",
        format_call("calculator", expr="1"),
        expression,
        format_answer(task.answer),
    ]
    engine = ScriptedEngine(tokenizer, lambda turn, _: script[turn])
    episodes = run_episodes(
        engine, [task], EnvContext(max_turns=4), group_size=1, max_context=10_000, chat="plain"
    )
    turns = episodes[0].turns
    assert [t.rewards["tool_error"] for t in turns] == [1.0, 1.0, 0.0, 0.0]
    assert turns[0].observation.startswith("<tool_response>error:") and "JSON" in turns[0].observation
    assert "schema" in turns[1].observation
    assert episodes[0].success
    [reward] = episode_rewards(episodes)
    assert reward.components == {"success": 1.0, "tool_error": 2.0}
    batch = collate(episodes, [reward], tokenizer)
    # The two malformed calls are penalised at the last token of their own turns.
    ends = episodes[0].turn_ends
    assert batch.token_rewards[0, ends[0]] == batch.token_rewards[0, ends[1]] == -0.1
    assert batch.token_rewards[0].sum() == torch.tensor(-0.2) and batch.rewards[0] == 1.0


def test_flaky_api_errors_reach_the_model_as_text(tiny):
    model, tokenizer = tiny
    task = tool_tasks("tool_flaky")[0]
    call = task.metadata["reference"][0]
    engine = ScriptedEngine(tokenizer, lambda turn, _: call if turn < 3 else format_answer(task.answer))
    ctx = EnvContext(max_turns=5, options={"flaky_failure_rate": 1.0, "flaky_max_failures": 2})
    [episode] = run_episodes(engine, [task], ctx, group_size=1, max_context=10_000, chat="plain")
    seen_by_model = [tokenizer.decode(c[0]) for c in engine.contexts]
    assert "503 service unavailable" in seen_by_model[1]
    assert "timeout after 2.0 s" in seen_by_model[2]
    observation_text = tokenizer.decode([t for t, p in zip(episode.ids, episode.policy) if not p])
    assert "503 service unavailable" in observation_text
    assert episode.success and len(episode.turns) == 4


def test_the_context_budget_ends_an_episode_as_truncated(tiny):
    model, tokenizer = tiny
    task = tool_tasks("tool_calc")[0]
    engine = ScriptedEngine(tokenizer, lambda turn, _: task.metadata["reference"][0], max_new_tokens=64)
    budget = 80
    [episode] = run_episodes(
        engine, [task], EnvContext(max_turns=20), group_size=1, max_context=budget, chat="plain"
    )
    assert episode.truncated and len(episode.turns) < 20
    assert len(episode.prompt_ids) + len(episode.ids) <= budget


def test_the_chat_template_format_renders_exactly_the_template(tiny):
    model, tokenizer = tiny
    tokenizer.chat_template = (
        "{% if tools %}<bos>system: tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<eos>\n"
        "{% endif %}{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant: {% endif %}"
    )
    task = tool_tasks("tool_db_get")[0]
    script = [task.metadata["reference"][0], format_answer(task.answer)]
    engine = ScriptedEngine(tokenizer, lambda turn, _: script[turn])
    [episode] = run_episodes(
        engine, [task], EnvContext(max_turns=3), group_size=1, max_context=10_000, chat="auto"
    )
    env = make_env(task, EnvContext())
    messages = [{"role": "user", "content": env.reset(task)}]
    for turn in episode.turns:
        messages.append({"role": "assistant", "content": turn.action})
        if turn.observation is not None:
            messages.append({"role": "user", "content": turn.observation})
    rendered = tokenizer.apply_chat_template(messages, tools=env.tool_schemas(), tokenize=False)
    assert tokenizer.decode(episode.prompt_ids + episode.ids) == rendered.rstrip("\n")
    assert rendered.startswith("<bos>system: tools db_get <eos>")  # the JSON-schema declarations reach it
    assert episode.success
    # The policy's tokens are exactly the actions and their end-of-turn token.
    policy_text = tokenizer.decode([t for t, p in zip(episode.ids, episode.policy) if p])
    assert policy_text == "<eos>".join(script) + "<eos>"


def test_a_group_shares_its_prompt_and_episodes_are_repeatable(tiny, tasks, sandbox):
    model, tokenizer = tiny
    ctx = EnvContext(sandbox, max_turns=2)
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=10))
    kw = dict(group_size=3, max_context=190, seed=5)
    a = run_episodes(engine, tasks[0][:2], ctx, generator=torch.Generator().manual_seed(1), **kw)
    b = run_episodes(engine, tasks[0][:2], ctx, generator=torch.Generator().manual_seed(1), **kw)
    assert [e.ids for e in a] == [e.ids for e in b]
    assert [e.group_id for e in a] == [0, 0, 0, 1, 1, 1]
    assert len({tuple(e.prompt_ids) for e in a[:3]}) == 1


def test_the_step_reward_hook_scores_each_turn(tiny):
    model, tokenizer = tiny
    task = tool_tasks("tool_db_get")[0]
    script = [task.metadata["reference"][0], format_answer(task.answer)]
    engine = ScriptedEngine(tokenizer, lambda turn, _: script[turn])
    episodes = run_episodes(
        engine, [task], EnvContext(max_turns=3), group_size=1, max_context=10_000, chat="plain"
    )
    [reward] = episode_rewards(
        episodes, step_fn=lambda task, steps: [0.5 if "<tool_call>" in s else 0.0 for s in steps]
    )
    assert reward.info["turn_rewards"] == [0.5, 0.0] and reward.components["step"] == 0.5
    assert reward.score == 1.5
    batch = collate(episodes, [reward], tokenizer)
    assert batch.token_rewards[0, episodes[0].turn_ends[0]] == 0.5


def test_a_template_whose_turns_do_not_end_with_eos_keeps_its_own_end_of_turn(tiny):
    model, tokenizer = tiny
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} END\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    task = tool_tasks("tool_db_get")[0].model_copy(update={"prompt": "say <eos> then work"})
    script = [task.metadata["reference"][0], format_answer(task.answer)]
    engine = ScriptedEngine(tokenizer, lambda turn, _: script[turn])
    [episode] = run_episodes(
        engine, [task], EnvContext(max_turns=3), group_size=1, max_context=10_000, chat="template"
    )
    observation = tokenizer.decode([t for t, p in zip(episode.ids, episode.policy) if not p])
    assert observation.startswith(" END\n[user] <tool_response>") and script[0] not in observation


def test_episodes_are_plain_records_that_pickle_without_live_state(tiny, tasks, sandbox):
    """The driver keeps each episode's environment and conversation to itself; what it returns (and a
    checkpoint pickles) is `types.Episode`, whose attempts carry the episode's real group id."""
    model, tokenizer = tiny
    engine = ScriptedEngine(tokenizer, lambda turn, _: "    return 0\n")
    episodes = run_episodes(
        engine, tasks[0][:2], EnvContext(sandbox, max_turns=2), group_size=2, max_context=10_000, chat="plain"
    )
    assert all(type(e) is Episode for e in episodes) and [e.group_id for e in episodes] == [0, 0, 1, 1]
    assert all(t.attempt.group_id == e.group_id for e in episodes for t in e.turns)
    assert not [v for e in episodes for v in vars(e).values() if isinstance(v, (Environment, Conversation))]
    assert pickle.loads(pickle.dumps(episodes)) == episodes
