"""The environment protocol: `reset(task) -> observation`, `step(action) -> Step`.

An episode is a conversation: the first observation is the prompt; each policy action (a turn of text)
goes to `step`, which executes it - code in the sandbox, a call to a simulated API, an answer checked
against the task's - and returns what comes back (appended to the context as observation tokens, never
trained on), the reward components of that step, and whether the episode is over.

Reward components come in two kinds. `outcome` components (answer correct, tool task solved) are read
from the episode's last step: the episode is judged on its final attempt. All others are process rewards
of their step (an improvement over the previous attempt, a malformed tool call) and are credited at the
last token of the turn that earned them. A step says whether the task is solved (`success`) and may
carry its attempt (`attempt`, the code environment), on which the reward function computes its own components.
Weights come from `reward.weights`, else the environment's `default_weights`.

A task names its environment in `env`: a built-in kind (`ENVIRONMENTS`), or a subclass of `Environment` in
the user's own package as `package.module:Class`, listed in the config's `env.plugins` so that it is
imported and checked when the config loads (docs/guides/environments.md). An environment of another
ecosystem is named through its adapter, `openenv:package.module:Class` or `verifiers:taskset-id`
(`ADAPTERS`, docs/guides/ecosystem-envs.md).
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from tempering.config import RunConfig
from tempering.config_sections import FEEDBACK_CHARS
from tempering.errors import ConfigError
from tempering.registry import check_call, load_callable
from tempering.types import Attempt, Task, Turn


class Step(NamedTuple):
    """What one action did."""

    observation: str | None
    """Text fed back to the model (None when the episode ends here)."""
    rewards: dict[str, float]
    """Reward components of this step."""
    done: bool
    info: dict[str, Any] = {}
    """Free-form extras of the environment (kept on the turn: `Turn.info`)."""
    success: bool = False
    attempt: Attempt | None = None
    passed: float | None = None
    hacking: tuple[str, ...] = ()
    """The step's outcome (`success` is read on the final step): the fields of `types.Turn`, which `as_turn`
    copies them to."""

    def as_turn(self, action: str, *, ended: bool = True, tokens: int = 0, computed: int = 0) -> Turn:
        """The record of `action` and this step's outcome (its observation is the driver's to set)."""
        return Turn(
            action,
            None,
            dict(self.rewards),
            dict(self.info),
            ended=ended,
            tokens=tokens,
            computed=computed,
            success=self.success,
            attempt=self.attempt,
            passed=self.passed,
            hacking=list(self.hacking),
        )


@dataclass
class EnvContext:
    """What environments may use; one per rollout batch, shared by its episodes."""

    sandbox: Any = None
    """A `tempering.sandbox.Sandbox` (code environments)."""
    max_turns: int = 1
    """Turns the driver will allow; an environment says in its observation how many are left."""
    feedback_chars: int = FEEDBACK_CHARS
    """Longest feedback text; longer is cut to its head and tail."""
    needs: frozenset[str] = frozenset()
    """What the reward functions need from an execution besides the verdicts (`rewards.NEEDS`)."""
    guards: bool = True
    """Whether an attempt a guard catches is rejected (`reward.guards`)."""
    guard_kinds: list[str] | None = None
    """The guards that check each attempt (`reward.guard_kinds`; None: all)."""
    partial: str = "always"
    """When a failing attempt earns part of the `tests` score (`reward.params.tests.partial`)."""
    options: dict[str, Any] = field(default_factory=dict)
    """`env.options` from the config, e.g. {flaky_failure_rate: 0.5}."""
    reference_cpu: dict[str, float | None] = field(default_factory=dict)
    """CPU time of each task's reference solution, measured once per run (the efficiency reward)."""
    agent: Any = None
    """The run's `AgentSection` when the user's agent runs the episodes (`agent.episodes`); None: the policy
    acts in the environment itself."""
    hidden: tuple[str, ...] = ()
    """Paths an agent may not see (the run directory)."""


def env_context(cfg: RunConfig, sandbox: Any, needs: set[str] | frozenset[str] = frozenset()) -> EnvContext:
    """What the environments of a run get: the sandbox, `env.*`, the reward-hacking guard settings and what
    the reward functions need from an execution (`RewardFunction.needs`)."""
    e, r = cfg.env, cfg.reward
    return EnvContext(
        sandbox=sandbox,
        max_turns=e.max_turns,
        feedback_chars=e.feedback_chars,
        needs=frozenset(needs),
        guards=r.guards,
        guard_kinds=r.guard_kinds,
        partial=(r.params.get("tests") or {}).get("partial", "always"),
        options=e.options.model_dump(),
        agent=cfg.agent if cfg.agent.entry or cfg.agent.command else None,
        hidden=(cfg.run.dir,),
    )


class Environment(ABC):
    """One episode of one task. Instances are created by `make_env` and are not reused."""

    kind: ClassVar[str]
    group_id: int = 0
    """The episode's group in its rollout batch (set by `make_env`; its attempts carry it)."""
    components: ClassVar[frozenset[str]] = frozenset()
    """Every reward component its steps report (names `reward.weights` may use besides the reward functions)."""
    outcome: ClassVar[frozenset[str]] = frozenset()
    """The components read from the final step only; the others are per-turn process rewards."""
    default_weights: ClassVar[dict[str, float]] = {}
    """Weights when `reward.weights` is unset (may name reward functions too, e.g. the code env's `format`)."""

    def __init__(self, ctx: EnvContext, seed: int = 0):
        self.ctx, self.seed = ctx, seed

    @abstractmethod
    def reset(self, task: Task) -> str:
        """Start an episode; returns the first observation (the prompt text)."""

    @abstractmethod
    def step(self, action: str) -> Step:
        """Apply one policy action."""

    @classmethod
    def step_batch(
        cls, envs: list[Environment], actions: list[str], pool: Executor | None = None
    ) -> list[Step]:
        """Step many environments of this kind on their actions (the rollout driver's call). The default
        steps each one, in `pool`'s threads when given; environments whose steps share work (the code
        environment: one sandbox batch, one linter run) override it."""
        pairs = list(zip(envs, actions))
        if pool is None:
            return [env.step(action) for env, action in pairs]
        return list(pool.map(lambda pair: pair[0].step(pair[1]), pairs))

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """Tools of this episode, as chat templates take them ({"type": "function", "function": schema});
        None for environments without tools."""
        return None


ENVIRONMENTS: dict[str, type[Environment]] = {}


def register(cls: type[Environment]) -> type[Environment]:
    ENVIRONMENTS[cls.kind] = cls
    return cls


def environment_class(name: str) -> type[Environment]:
    """The environment a task's `env` names: a built-in kind (`ENVIRONMENTS`), or user code as
    `package.module:Class` (listed in `env.plugins`). ConfigError saying what is wrong otherwise."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name:
        known = ", ".join(ENVIRONMENTS)
        raise ConfigError(f"unknown env '{name}'; known: {known} (or 'package.module:Class')")
    return _plugin_class(name)


ADAPTERS = {
    "openenv": "tempering.envs.openenv:openenv_environment",
    "verifiers": "tempering.envs.verifiers:verifiers_environment",
}
"""Ecosystem -> the function that makes a tempering environment of one of its environments, by name."""


@functools.cache
def _plugin_class(spec: str) -> type[Environment]:
    """Import `package.module:Class` (or an ecosystem's environment through its adapter) and check that
    `make_env` can build episodes of it (once per name)."""
    ecosystem, _, name = spec.partition(":")
    adapter = ADAPTERS.get(ecosystem)
    cls = load_callable(adapter)(name) if adapter else load_callable(spec, "environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"environment '{spec}' is not a subclass of tempering.envs.Environment")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(f"environment '{spec}' does not implement {missing}")
    check_call(cls, spec, "environment", EnvContext(), seed=0)  # the call of make_env
    return cls


def make_env(task: Task, ctx: EnvContext, seed: int = 0, group_id: int = 0) -> Environment:
    try:
        cls = environment_class(task.env)
    except ConfigError as e:
        raise ValueError(f"task '{task.id}': {e}") from None
    env = cls(ctx, seed)
    env.group_id = group_id
    return env


def step_all(envs: list[Environment], actions: list[str], pool: Executor) -> list[Step]:
    """Each environment's step on its action, batched per environment kind (`step_batch`); in order."""
    steps: list = [None] * len(envs)
    kinds: dict[type, list[int]] = {}
    for i, env in enumerate(envs):
        kinds.setdefault(type(env), []).append(i)
    for cls, rows in kinds.items():
        for i, step in zip(rows, cls.step_batch([envs[i] for i in rows], [actions[i] for i in rows], pool)):
            steps[i] = step
    return steps


def clip_middle(text: str, limit: int) -> str:
    """Keep the head and the tail of a long text (a traceback's cause is at its end, its context at its start)."""
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head - 20
    return f"{text[:head]}\n... [{len(text) - head - tail} chars cut] ...\n{text[-tail:]}"
