"""OpenEnv adapter: an environment written for OpenEnv (`pip install 'tempering[openenv]'`) as a task's `env`.

A task names it `openenv:package.module:Class`, `Class` a subclass of OpenEnv's
`openenv.core.env_server.interfaces.Environment`, and the config lists the same string in `env.plugins`.
The class runs in this process, one instance per episode: `reset(seed, episode_id, **task.metadata["reset"])`
starts it and each model turn becomes one `step(Action)`. The first observation is the task's prompt when it
has one (what SFT trains on, so make it what the reset shows), else the reset observation. OpenEnv's actions and
observations are pydantic models, so the adapter maps text both ways: the turn fills the action's one
required string field, and an observation reads as its own string fields (not `done`, `reward`, `metadata`)
joined by newlines. The observation's `reward` (what the environment or its rubric computed) is the step's
`openenv` component, a process reward credited at its turn; `done` ends the episode; `success` is
`metadata["success"]` when the environment sets it, else a reward of at least 1.

Not covered: OpenEnv's HTTP server, whose `/reset` and `/step` routes build a fresh environment per
request (an episode only lives on its WebSocket session), and MCP tool actions.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

from tempering.envs.base import Environment, Step
from tempering.errors import ConfigError
from tempering.registry import load_callable
from tempering.types import Task

BASE_FIELDS = {"done", "reward", "metadata"}
"""Fields every OpenEnv observation has; the rest are what it says."""


def _openenv():
    try:
        from openenv.core.env_server import interfaces, types
    except ImportError:
        raise ConfigError("openenv is not installed: pip install 'tempering[openenv]' (or openenv)") from None
    return interfaces, types


@functools.cache
def openenv_environment(spec: str) -> type[Environment]:
    """The tempering environment of OpenEnv's `package.module:Class` (checked now: ConfigError naming
    what is wrong)."""
    interfaces, types = _openenv()
    cls = load_callable(spec, "openenv environment")
    if not (isinstance(cls, type) and issubclass(cls, interfaces.Environment)):
        raise ConfigError(f"openenv environment '{spec}' is not a subclass of OpenEnv's Environment")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(f"openenv environment '{spec}' does not implement {missing}")
    action_cls = _action_class(cls, types.Action, spec)
    field = _text_field(action_cls, spec)
    return type(
        f"OpenEnv_{cls.__name__}",
        (OpenEnvEnv,),
        {"kind": f"openenv:{spec}", "openenv_class": cls, "action_class": action_cls, "action_field": field},
    )


def _action_class(cls: type, base: type, spec: str) -> type:
    """The action type `step` takes: its annotation, else the class's first generic argument."""
    try:
        hint = typing.get_type_hints(cls.step).get("action")
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to the generic arguments
        hint = None
    candidates = [hint] + [a for b in getattr(cls, "__orig_bases__", ()) for a in typing.get_args(b)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, base) and candidate is not base:
            return candidate
    raise ConfigError(f"openenv environment '{spec}': cannot tell its Action class (annotate step's action)")


def _text_field(action_cls: type, spec: str) -> str:
    """The action's one required string field, which a model turn fills."""
    required = [name for name, f in action_cls.model_fields.items() if f.is_required()]
    if len(required) == 1 and action_cls.model_fields[required[0]].annotation is str:
        return required[0]
    raise ConfigError(
        f"openenv environment '{spec}': its action {action_cls.__name__} needs exactly one required "
        f"string field for the model's text (it requires: {', '.join(required) or 'none'})"
    )


def observation_text(observation: Any) -> str:
    """An observation's own string fields, joined by newlines."""
    values = [
        getattr(observation, name) for name in type(observation).model_fields if name not in BASE_FIELDS
    ]
    return "\n".join(v for v in values if isinstance(v, str) and v)


class OpenEnvEnv(Environment):
    """One episode of an OpenEnv environment (a subclass per OpenEnv class: `openenv_environment`)."""

    kind = "openenv"
    components = frozenset({"openenv"})
    default_weights = {"openenv": 1.0}
    openenv_class: Any = None
    action_class: Any = None
    action_field: str = ""

    def reset(self, task: Task) -> str:
        self.env = self.openenv_class()
        options = dict(task.metadata.get("reset") or {})
        observation = self.env.reset(seed=self.seed, episode_id=task.id, **options)
        return task.prompt or observation_text(observation)

    def step(self, action: str) -> Step:
        observation = self.env.step(self.action_class(**{self.action_field: action}))
        reward = float(observation.reward or 0.0)
        success = bool(observation.metadata.get("success", reward >= 1.0))
        if observation.done:
            self.env.close()
        text = None if observation.done else observation_text(observation)
        return Step(text, {"openenv": reward}, bool(observation.done), dict(observation.metadata), success)
