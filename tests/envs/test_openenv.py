"""The OpenEnv adapter (`envs/openenv.py`) on the echo environment of `tests/fixtures/openenv_echo`, written
as `openenv init` lays one out: named `openenv:package.module:Class`, checked at load, stepped in process."""

import sys
import textwrap
from pathlib import Path

import pytest

from tempering.config import load_config
from tempering.envs import EnvContext, environment_class, make_env
from tempering.envs.base import _plugin_class
from tempering.envs.openenv import openenv_environment
from tempering.errors import ConfigError
from tempering.types import Task

ROOT = Path(__file__).resolve().parents[2]
ECHO = "openenv:openenv_echo.server.echo_environment:EchoEnvironment"


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """The fixture package importable; each test resolves names anew."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fixtures"))
    _plugin_class.cache_clear()
    openenv_environment.cache_clear()
    yield
    _plugin_class.cache_clear()
    openenv_environment.cache_clear()


def echo_task(word="abc", prompt=""):
    return Task(id="echo-0", domain="echo", env=ECHO, prompt=prompt, metadata={"reset": {"word": word}})


def test_a_missing_openenv_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)  # what an environment without it sees
    with pytest.raises(ConfigError, match=r"^openenv is not installed: pip install 'tempering\[openenv\]'"):
        environment_class(ECHO)


def test_an_episode_steps_the_environment_and_reads_its_reward():
    pytest.importorskip("openenv")
    task = echo_task("abc")
    env = make_env(task, EnvContext(max_turns=3))
    assert env.reset(task) == "Echo: abc\nAnswer: "  # the reset observation's text (the task has no prompt)
    first = env.step("abd\n")
    assert first.rewards == {"openenv": pytest.approx(2 / 3)} and not first.done and not first.success
    assert first.observation == "abd" and first.info == {"step": 1}  # the echoed message; its metadata
    last = env.step("abc")
    assert last.rewards == {"openenv": 1.0} and last.done and last.success and last.observation is None


def test_the_task_prompt_when_set_is_the_first_observation():
    pytest.importorskip("openenv")
    task = echo_task("abc", prompt="Say abc back.\n")
    assert make_env(task, EnvContext()).reset(task) == "Say abc back.\n"


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_openenv.py").write_text(
        textwrap.dedent("""
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action, Observation

        class TwoFields(Action):
            x: int
            y: int

        class Grid(Environment[TwoFields, Observation, object]):
            def reset(self, seed=None, episode_id=None, **kw):
                return Observation()
            def step(self, action, timeout_s=None, **kw):
                return Observation(done=True)
            @property
            def state(self):
                return None

        class NoStep(Environment):
            def reset(self, seed=None, episode_id=None, **kw):
                return Observation()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("openenv_echo.models:EchoAction", "is not a subclass of OpenEnv's Environment"),
        ("openenv_echo.server.echo_environmen:EchoEnvironment", "cannot import module"),
        (
            "user_openenv:Grid",
            "its action TwoFields needs exactly one required string field for the model's text (it requires: x, y)",
        ),
        ("user_openenv:NoStep", "does not implement state, step"),
    ],
)
def test_a_bad_openenv_environment_is_one_line_naming_it(user_module, spec, message):
    pytest.importorskip("openenv")
    with pytest.raises(ConfigError) as e:
        environment_class(f"openenv:{spec}")
    assert f"openenv environment '{spec}'" in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_config_lists_it_in_env_plugins_and_weighs_its_component():
    pytest.importorskip("openenv")
    cfg = load_config(
        ROOT / "configs" / "smoke.yaml", [f"env.plugins=[{ECHO}]", "reward.weights={openenv: 1.0}"]
    )
    assert cfg.env.plugins == [ECHO]
    with pytest.raises(ConfigError, match="env.plugins: openenv environment 'openenv_echo.nope:Echo'"):
        load_config(ROOT / "configs" / "smoke.yaml", ["env.plugins=[openenv:openenv_echo.nope:Echo]"])
