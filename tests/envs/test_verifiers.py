"""The verifiers adapter (`envs/verifiers.py`) on the taskset of `tests/fixtures/verifiers_env`, written as
verifiers 0.4 tasksets are: its tasks written as task files, its rewards scoring each reply."""

import json
import sys
from pathlib import Path

import pytest

from tempering.envs import EnvContext, environment_class, make_env
from tempering.envs import verifiers as adapter
from tempering.envs.base import _plugin_class
from tempering.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ENV = "verifiers:vf-reverse"


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fixtures" / "verifiers_env"))
    for cached in (_plugin_class, adapter.load_taskset, adapter.verifiers_environment):
        cached.cache_clear()
    yield
    for cached in (_plugin_class, adapter.load_taskset, adapter.verifiers_environment):
        cached.cache_clear()


def test_a_missing_verifiers_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(
        ConfigError, match=r"^verifiers is not installed: pip install 'tempering\[verifiers\]'"
    ):
        environment_class(ENV)


@pytest.fixture()
def tasks():
    pytest.importorskip("verifiers.v1")
    return adapter.verifiers_tasks("vf-reverse", {"num_tasks": 6})


def test_the_tasksets_tasks_become_tasks_of_its_environment(tasks):
    assert [t.id for t in tasks] == [f"reverse-{i}" for i in range(6)]
    word = tasks[0].metadata["verifiers"]["data"]["word"]
    assert tasks[0].env == ENV and tasks[0].domain == "vf-reverse"
    assert tasks[0].prompt == f"Reverse: {word}\nAnswer: " and tasks[0].reference_solution == word[::-1]


def test_a_reply_is_scored_by_the_tasks_own_rewards_and_metrics(tasks):
    task = tasks[0]
    answer = task.reference_solution
    env = make_env(task, EnvContext())
    assert env.reset(task) == task.prompt
    right = env.step(answer)
    assert right.done and right.success and right.observation is None
    assert right.rewards == {"verifiers": pytest.approx(1.2)}  # letters 1.0 + one_line 0.2 (its weight)
    assert right.info == {"rewards": {"letters": 1.0, "one_line": 1.0}, "metrics": {"checked": 1.0}}
    env = make_env(task, EnvContext())
    env.reset(task)
    wrong = env.step(answer[:-1] + "\x00\nmore")  # checked in the subprocess runtime, from a file
    assert not wrong.success and wrong.info["metrics"] == {"checked": 0.0}
    letters = (len(answer) - 1) / len(answer)
    assert wrong.rewards == {"verifiers": pytest.approx(letters)}  # two lines: no one_line credit


def test_a_reward_that_fails_on_a_reply_scores_zero(tasks, monkeypatch):
    import verifiers.v1 as vf

    env = make_env(tasks[0], EnvContext())
    env.reset(tasks[0])

    async def fails(trace, runtime=None):
        raise vf.TaskError("task ReverseTask scoring: ValueError: no")

    monkeypatch.setattr(env.vf_task, "score", fails)
    step = env.step("x")
    assert step.rewards == {"verifiers": 0.0} and step.done and "ValueError: no" in step.info["error"]


@pytest.mark.parametrize(
    "taskset, options, message",
    [
        (
            "vf-reverze",
            {},
            "verifiers taskset 'vf-reverze': ModuleNotFoundError: taskset 'vf-reverze' not found",
        ),
        ("vf-reverse", {"num_taskz": 3}, "verifiers taskset 'vf-reverse': ValidationError"),
    ],
)
def test_a_bad_taskset_is_named(taskset, options, message):
    pytest.importorskip("verifiers.v1")
    with pytest.raises(ConfigError) as e:
        adapter.verifiers_tasks(taskset, options)
    assert str(e.value).startswith(message)


def test_the_command_writes_task_files_or_says_error(tmp_path, capsys):
    pytest.importorskip("verifiers.v1")
    assert adapter.main(["vf-reverse", str(tmp_path), "--heldout", "2", "--options", '{"num_tasks": 5}']) == 0
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert [t["id"] for t in train + heldout] == [f"reverse-{i}" for i in range(5)] and len(heldout) == 2
    assert adapter.main(["vf-reverse", str(tmp_path), "--heldout", "5", "--options", '{"num_tasks": 5}']) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: verifiers taskset 'vf-reverse' has 5 tasks") and err.count("\n") == 1
