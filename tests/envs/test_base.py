"""Environments named by import path (`package.module:Class`): resolved and checked by
`envs.environment_class`, built by `make_env`."""

import textwrap

import pytest

from tempering import envs
from tempering.envs import EnvContext, make_env
from tempering.errors import ConfigError
from tempering.types import Task


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A module `user_envs` of environments a user got wrong (and one right)."""
    (tmp_path / "user_envs.py").write_text(
        textwrap.dedent("""
        from tempering.envs import Environment, Step

        class Echo(Environment):
            kind = "echo"
            def reset(self, task):
                return task.prompt
            def step(self, action):
                return Step(None, {}, True, success=action == "x")

        class NoStep(Environment):
            def reset(self, task):
                return task.prompt

        class OneArgument(Echo):
            def __init__(self, ctx):
                super().__init__(ctx)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    "name, message",
    [
        ("user_envs:NoStep", "environment 'user_envs:NoStep' does not implement step"),
        (
            "user_envs:OneArgument",
            "environment 'user_envs:OneArgument' cannot take the arguments the run passes",
        ),
        ("user_envs:Nope", "module 'user_envs' has no callable 'Nope'"),
        ("echo", "unknown env 'echo'; known: "),
    ],
)
def test_environment_class_says_what_is_wrong(user_module, name, message):
    with pytest.raises(ConfigError) as e:
        envs.environment_class(name)
    assert message in str(e.value)


def test_make_env_builds_a_user_environment_named_by_import_path(user_module):
    task = Task(id="t", domain="d", prompt="p", env="user_envs:Echo")
    env = make_env(task, EnvContext())
    assert type(env).__name__ == "Echo" and env.reset(task) == "p" and env.step("x").success
    with pytest.raises(ValueError, match="task 't': unknown env 'ech'"):
        make_env(task.model_copy(update={"env": "ech"}), EnvContext())


def test_env_context_has_named_fields_and_options_hold_only_env_options():
    from tempering.config import load_config
    from tempering.envs import env_context

    cfg = load_config(
        "configs/smoke.yaml",
        [
            "reward.guards=false",
            "reward.guard_kinds=[exit_before_tests]",
            "reward.params={tests: {partial: examples}}",
        ],
    )
    ctx = env_context(cfg, sandbox=None, needs={"lint"})
    assert ctx.needs == {"lint"} and ctx.guards is False and ctx.guard_kinds == ["exit_before_tests"]
    assert ctx.partial == "examples" and ctx.options == cfg.env.options.model_dump()
