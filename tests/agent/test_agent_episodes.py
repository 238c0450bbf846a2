"""Episodes of the user's own agent (`agent.episodes`): what is trained is what the engine computed, only the
model's own tokens carry loss, a rerun samples the same bits, and a hostile agent is confined and costs the
run nothing but its own sample. The agents are `tests/fixtures/agents`, written with the plain `openai`
client."""

import json
import socket

import pytest
import torch

from tempering.agent.episodes import sample_episodes
from tempering.agent.runner import resolve_isolation
from tempering.config_sections import AgentSection
from tempering.envs import EnvContext
from tempering.inference.engine import SamplingParams, make_engine
from tempering.models.loading import load_model, load_tokenizer
from tempering.rewards import RewardFunction
from tempering.rollout.batch import collate
from tempering.types import Task
from tests.helpers.runs import ROOT

AGENTS = ROOT / "tests" / "fixtures" / "agents"


@pytest.fixture()
def agents_path(monkeypatch):
    monkeypatch.syspath_prepend(str(AGENTS))


def episodes(model_dir, tasks, ctx, group_size=2, seed=0):
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    engine = make_engine(model, tokenizer, SamplingParams(1.0, 1.0, 12))
    out = sample_episodes(
        engine,
        tasks,
        ctx,
        group_size=group_size,
        max_context=192,
        generator=torch.Generator().manual_seed(seed),
        seed=seed,
    )
    return out, engine, tokenizer


def test_an_agents_calls_are_trained_as_computed_only_its_own_tokens_carry_loss_and_reruns_agree(
    agents_path, tiny_model_dir, tasks, sandbox
):
    section = AgentSection(entry="plain_agent:two_calls", reward="both", concurrency=3)
    ctx = EnvContext(sandbox=sandbox, agent=section)
    code_tasks = tasks[0][:2]
    first, engine, tokenizer = episodes(tiny_model_dir, code_tasks, ctx)
    assert len(first) == 4 and [e.task.id for e in first] == [t.id for t in code_tasks for _ in range(2)]
    for e in first:
        kept = {k: e.proxy[k] for k in ("failed", "timeout", "forks", "token_exact_fraction")}
        assert kept == {"failed": 0.0, "timeout": 0.0, "forks": 0.0, "token_exact_fraction": 1.0}
        assert len(e.turns) == 2 and len(e.turn_ends) == 2
        runs, start = [], 0
        for end in e.turn_ends:  # each policy span is exactly one call's sampled tokens
            span = [t for t, p in zip(e.ids[start : end + 1], e.policy[start : end + 1]) if p]
            runs.append(span)
            start = end + 1
        texts = [tokenizer.decode([t for t in span if t not in engine.stop_ids]) for span in runs]
        assert texts == [t.action for t in e.turns]  # (the last action is the agent's answer: its reply)
        observed = tokenizer.decode([t for t, p in zip(e.ids, e.policy) if not p])
        assert "Check it and write it again." in observed  # the agent's own turn: attended, not trained
        assert e.turns[-1].rewards["agent"] == float(len(e.turns[-1].action) % 2)
    scored = RewardFunction({"tests": 1.0, "agent": 0.5}).score(first)
    batch = collate(first, scored, tokenizer)
    for i, e in enumerate(first):
        assert batch.response_mask[i, : len(e.ids)].bool().tolist() == e.policy
        assert batch.prompt_ids[i, -len(e.prompt_ids) :].tolist() == e.prompt_ids
    again, _, _ = episodes(tiny_model_dir, code_tasks, ctx)  # the lockstep: the same batches, bit for bit
    assert [(e.ids, e.logprobs) for e in again] == [(e.ids, e.logprobs) for e in first]


@pytest.mark.skipif(resolve_isolation("auto") is None, reason="bubblewrap cannot start here")
def test_a_hostile_agent_is_confined_and_costs_the_run_only_its_own_sample(
    agents_path, tiny_model_dir, tasks, sandbox, tmp_path, monkeypatch
):
    code = tmp_path / "code"  # an import root of the trainer's, with the run directory inside it
    run_dir = code / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "secret.txt").write_text("checkpoint bytes")
    (code / "visible.txt").write_text("code")
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("TEMPERING_TEST_SECRET", "s3cret")
    listener = socket.create_server(("127.0.0.1", 0))  # something of the host's on loopback
    target = {
        "port": listener.getsockname()[1],
        "file": str(run_dir / "secret.txt"),
        "variable": "TEMPERING_TEST_SECRET",
    }
    hostile = Task(id="hostile", domain="x", prompt=json.dumps(target), env="answer", answer="no")
    sleeper = Task(id="sleeper", domain="x", prompt="sleep", env="answer", answer="no")
    section = AgentSection(entry="plain_agent:by_prompt", timeout_s=6.0, patience_s=1.0, isolation="bwrap")
    ctx = EnvContext(sandbox=sandbox, agent=section, hidden=(str(run_dir),))
    got, engine, _ = episodes(tiny_model_dir, [hostile, sleeper, tasks[0][0]], ctx, group_size=1)
    listener.close()
    seen = json.loads(got[0].turns[-1].action)
    assert seen["host_loopback"] != "connected" and seen["outside"] != "connected"
    assert seen["run_file"] == "FileNotFoundError" and seen["env"] is None
    assert (seen["forged_key"], seen["no_key"], seen["open_session"], seen["huge"]) == (401, 401, 401, 413)
    assert 429 in seen["flood"] and 200 in seen["flood"]
    assert got[0].proxy["failed"] == 0.0  # it ran to its end: it only lost what it attacked
    assert got[1].truncated and got[1].proxy == {"failed": 1.0, "timeout": 1.0} and not got[1].ids
    honest = got[2]
    assert honest.proxy["failed"] == 0.0 and honest.proxy["token_exact_fraction"] == 1.0
    assert len(honest.turns) == 2 and sum(honest.policy) > 0
    killer = Task(id="killer", domain="x", prompt="kill", env="answer", answer="no")
    (killed,) = sample_episodes(engine, [killer], ctx, group_size=1, max_context=192)
    assert killed.turns[-1].action == "still here"  # kill(-1) spares the caller and the server (PID 1)
    (after,) = sample_episodes(engine, [tasks[0][1]], ctx, group_size=1, max_context=192)
    assert after.proxy["failed"] == 0.0 and len(after.turns) == 2  # the same server, still serving


def test_the_agents_sdk_code_agent_runs_its_examples_and_asks_again(
    agents_path, tiny_model_dir, tasks, sandbox, monkeypatch
):
    pytest.importorskip("agents")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "agents"))
    ctx = EnvContext(sandbox=sandbox, agent=AgentSection(entry="sdk_code_agent:solve"))
    got, _, _ = episodes(tiny_model_dir, tasks[0][:4], ctx, group_size=1)
    for e in got:  # a random model fails its examples: the agent shows the failure and asks once more
        assert e.proxy["failed"] == 0.0 and e.proxy["token_exact_fraction"] == 1.0 and e.proxy["forks"] == 0.0
        assert len(e.turns) == 2 and "Write it again." in e.turns[0].observation


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["agent.entry=no_such_module:solve"], "agent.entry"),
        (["agent.entry=json:dumps"], "cannot take the arguments"),
        (["agent.entry=plain_agent:one_call", "rollout.engine=vllm"], "rollout.engine: local"),
        (["agent.command=[no-such-agent-binary]"], "not an executable"),
        (["agent.entry=plain_agent:one_call", "agent.reward=agent"], "needs a weight for 'agent'"),
    ],
)
def test_a_bad_agent_setting_is_one_error_at_load_time(agents_path, overrides, message):
    from tempering.config import load_config
    from tempering.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "smoke.yaml", ["reward.weights={tests: 1.0}", *overrides])
