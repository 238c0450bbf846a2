"""Environments: what executes a policy's action and answers it (docs/internals/architecture.md).

    code            the program is run against the task's tests; failures come back as feedback
    answer          the final answer is checked (arithmetic, Countdown)
    tool            tool calls against deterministic simulated APIs (calculator, database, search, flaky)
    reasoning_gym   a task from the `reasoning-gym` generators, scored by its verifier

A task names its environment (`Task.env`): one of these, or `package.module:Class` for one of the user's own
(listed in `env.plugins`); `make_env` builds one per episode.
"""

from tempering.envs import answer, code, gym, tools  # noqa: F401  (registers the environments)
from tempering.envs.base import (
    ENVIRONMENTS,
    EnvContext,
    Environment,
    Step,
    clip_middle,
    env_context,
    environment_class,
    make_env,
    register,
    step_all,
)

__all__ = [
    "ENVIRONMENTS",
    "EnvContext",
    "Environment",
    "Step",
    "clip_middle",
    "env_context",
    "environment_class",
    "make_env",
    "register",
    "step_all",
]
