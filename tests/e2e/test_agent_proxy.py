"""Your own agent trained end to end through the recording proxy (`agent.entry`): a multi-turn agent written
with the plain `openai` client on the smoke recipe, killed and resumed to the uninterrupted run's rows, and
the same agent on two asynchronous Ray workers writing the local backend's rows."""

import json
import os

import pytest

from tests.helpers.runs import ROOT, kill_after_checkpoint, metrics, stable, tempering

FAST = ["sft.steps=4", "eval.every=0", "tracking.tensorboard=false", "checkpoint.every=1", "train.steps=4"]
FAST += ["data.num_heldout=4", "eval.samples=1"]  # the evaluations run the agent too: keep them small


@pytest.fixture()
def agents_path(monkeypatch):
    paths = [str(ROOT / "tests" / "fixtures" / "agents"), str(ROOT / "examples" / "agents")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.mark.slow
def test_an_agent_trains_through_the_proxy_and_resumes_exactly(agents_path, tmp_path):
    overrides = [
        "agent.entry=plain_agent:two_calls",
        "agent.reward=both",
        "reward.weights={tests: 1.0, format: 0.1, agent: 0.5}",
        "rollout.max_new_tokens=12",
    ]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    tempering("train", "configs/smoke.yaml", f"run.dir={reference}", *FAST, *overrides)
    kill_after_checkpoint(killed, 2, *FAST, *overrides)
    tempering("train", "configs/smoke.yaml", f"run.dir={killed}", *FAST, *overrides)
    rows = stable(metrics(reference))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert stable(metrics(killed)) == rows  # the lockstep proxy samples the same bits after a resume
    for r in rows:
        assert r["proxy/token_exact_fraction"] == 1.0 and r["proxy/forks"] == 0.0
        assert r["agent/failed"] == 0.0 and r["num_turns/mean"] == 2.0 and "reward/agent/mean" in r
    samples = [json.loads(x) for x in (reference / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert all(len(s["turns"]) == 2 and "agent" in s["turns"][-1]["rewards"] for s in samples)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.xdist_group("ray")
def test_an_agent_on_two_asynchronous_ray_workers_writes_the_local_backends_rows(agents_path, tmp_path):
    pytest.importorskip("ray")
    agent = ["agent.entry=plain_agent:two_calls", "rollout.max_new_tokens=12", "rollout.max_staleness=1"]
    agent += ["rollout.shards=4", *FAST]
    local, remote = tmp_path / "local", tmp_path / "ray"
    tempering("train", "configs/smoke.yaml", f"run.dir={local}", *agent)
    two = ["distributed.backend=ray", "rollout.workers=2", "rollout.worker_cpus=0.5"]
    tempering("train", "configs/smoke.yaml", f"run.dir={remote}", *agent, *two)
    pool = ("timing_s/", "perf/", "dist/", "sync/")
    same = lambda rows: [{k: v for k, v in r.items() if not k.startswith(pool)} for r in rows]  # noqa: E731
    assert same(metrics(remote)) == same(metrics(local))
    assert [r["async/staleness/max"] for r in metrics(remote)] == [0, 1, 1, 1]
    assert all(r["proxy/token_exact_fraction"] == 1.0 for r in metrics(remote))
