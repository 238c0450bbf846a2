"""Environments of other ecosystems trained end to end: an OpenEnv environment (`tests/fixtures/openenv_echo`)
and a verifiers taskset (`tests/fixtures/verifiers_env`), each through the smoke recipe, resumed exactly,
its rewards those the ecosystem's own code computed. Skipped where the package is not installed."""

import json
import os
import random

import pytest

from tests.helpers.runs import ROOT, kill_after_checkpoint, metrics, stable, tempering

FIXTURES = ROOT / "tests" / "fixtures"
OPENENV = "openenv:openenv_echo.server.echo_environment:EchoEnvironment"
VERIFIERS = "verifiers:vf-reverse"
FAST = ["sft.steps=4", "eval.every=0", "tracking.tensorboard=false", "checkpoint.every=1", "train.steps=4"]


@pytest.fixture()
def fixtures_path(monkeypatch):
    """The fixture packages importable here and in the runs, as `pip install` would make them."""
    paths = [str(FIXTURES), str(FIXTURES / "verifiers_env")]
    for path in paths:
        monkeypatch.syspath_prepend(path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])]))


def letters_in_place(answer: str, expected: str) -> float:
    hits = sum(a == b for a, b in zip(answer, expected))
    return hits / max(len(expected), len(answer), 1)


def echo_tasks(out, num_train=40, num_heldout=8):
    """Task files of the echo environment: the reset names the word, the prompt is what the reset shows."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 5))) for _ in range(80)})
    rng.shuffle(words)
    rows = [
        {
            "id": f"echo-{i}",
            "domain": "echo",
            "env": OPENENV,
            "prompt": f"Echo: {w}\nAnswer: ",
            "reference_solution": w + "\n",
            "metadata": {"reset": {"word": w}},
        }
        for i, w in enumerate(words[: num_train + num_heldout])
    ]
    for name, part in (("train", rows[:num_train]), ("heldout", rows[num_train:])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


def first_samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples" / "step_000001.jsonl").read_text().splitlines()]


def train_and_resume(tmp_path, overrides):
    """The rows of an uninterrupted run, after checking that a run killed at step 2 resumes to them."""
    reference = tmp_path / "reference"
    tempering("train", "configs/smoke.yaml", f"run.dir={reference}", *FAST, *overrides)
    killed = tmp_path / "killed"
    kill_after_checkpoint(killed, 2, *FAST, *overrides)
    tempering("train", "configs/smoke.yaml", f"run.dir={killed}", *FAST, *overrides)
    rows = stable(metrics(reference))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert stable(metrics(killed)) == rows
    return rows, reference


@pytest.mark.slow
def test_an_openenv_environment_trains_on_its_own_rewards_and_resumes(fixtures_path, tmp_path):
    pytest.importorskip("openenv")
    echo_tasks(tmp_path)
    overrides = [
        f"data.train_file={tmp_path / 'train.jsonl'}",
        f"data.heldout_file={tmp_path / 'heldout.jsonl'}",
        f"env.plugins=[{OPENENV}]",
        "reward.weights={openenv: 1.0}",
        "rollout.max_new_tokens=8",
    ]
    rows, run_dir = train_and_resume(tmp_path / "runs", overrides)
    assert all("reward/openenv/mean" in r for r in rows)
    tasks = {json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "train.jsonl").open()}
    samples = first_samples(run_dir)
    for s in samples:  # the reward is the echo environment's: letters of its word in place
        word = tasks[s["task_id"]]["metadata"]["reset"]["word"]
        turn = s["turns"][0]
        assert set(turn["rewards"]) == {"openenv"}
        assert turn["rewards"]["openenv"] == pytest.approx(letters_in_place(turn["action"].strip(), word))
    assert len({s["turns"][0]["rewards"]["openenv"] for s in samples}) > 1


@pytest.mark.slow
def test_a_verifiers_taskset_trains_on_its_own_rewards_and_resumes(fixtures_path, tmp_path):
    pytest.importorskip("verifiers.v1")
    data = tmp_path / "data"
    from tempering.envs.verifiers import main

    assert main(["vf-reverse", str(data), "--heldout", "8", "--options", '{"num_tasks": 48}']) == 0
    overrides = [
        f"data.train_file={data / 'train.jsonl'}",
        f"data.heldout_file={data / 'heldout.jsonl'}",
        f"env.plugins=[{VERIFIERS}]",
        "reward.weights={verifiers: 1.0}",
        "rollout.max_new_tokens=8",
    ]
    rows, run_dir = train_and_resume(tmp_path / "runs", overrides)
    assert all("reward/verifiers/mean" in r for r in rows)
    tasks = {json.loads(line)["id"]: json.loads(line) for line in (data / "train.jsonl").open()}
    samples = first_samples(run_dir)
    for s in samples:  # the taskset's rewards, weighted as it weights them (letters 1.0, one_line 0.2)
        answer, turn = tasks[s["task_id"]]["reference_solution"], s["turns"][0]
        lines = turn["action"].splitlines()
        letters = letters_in_place(lines[0].strip() if lines else "", answer)
        assert turn["rewards"] == pytest.approx({"verifiers": letters + 0.2 * float(len(lines) <= 1)})
    assert len({s["reward"] for s in samples}) > 1
