"""Checks of a `RunConfig` that need code or span fields, run by its validator at load time.

Range checks live on the fields themselves (`Field(ge=..)`); what is here needs more than one value or an
import: registry names, user functions named as `package.module:function` (imported now and called with
the arguments the run will pass, as a signature check), `reward.params` against the components'
keyword parameters, the environments of `env.plugins` (`package.module:Class`) and their component names in
`reward.weights`. Each failure is a ValueError whose message starts with
the key, which `load_config` turns into a one-line ConfigError - before the run directory is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tempering.config import CHECKS, RunConfig
from tempering.errors import ConfigError
from tempering.registry import ARG, check_call, load_callable

if TYPE_CHECKING:
    from tempering.envs import Environment


def check_config(cfg: RunConfig) -> None:
    _check_algo(cfg)
    _check_rewards(cfg, _environments(cfg))
    _check_cross_fields(cfg)


CHECKS.append(check_config)


def _user_function(key: str, spec: str, what: str, *args: Any, **kwargs: Any) -> Any:
    """Import `package.module:function` and check it takes the run's call; errors name the key."""
    fn = _import(key, spec, what)
    try:
        check_call(fn, spec, what, *args, **kwargs)
    except ConfigError as e:
        raise ValueError(f"{key}: {e}") from None
    return fn


def _import(key: str, spec: str, what: str) -> Any:
    try:
        return load_callable(spec, what)
    except ConfigError as e:
        raise ValueError(f"{key}: {e}") from None


def _known(key: str, name: str, registry: dict[str, Any]) -> bool:
    """True for a registry name, False for user code (`a:b`); a ValueError listing the valid names otherwise."""
    if name in registry:
        return True
    if ":" in name:
        return False
    raise ValueError(
        f"{key}: unknown name '{name}'; valid: {', '.join(registry)} (or 'package.module:function')"
    )


def _check_algo(cfg: RunConfig) -> None:
    """The estimator and the policy loss bound as the run binds them (`training.algorithm`): names, imports, keywords."""
    from tempering.algos import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
    from tempering.training.algorithm import bind_estimator, bind_policy_loss

    a = cfg.algo
    _known("algo.estimator", a.estimator, ADVANTAGE_ESTIMATORS)
    _known("algo.policy_loss", a.policy_loss, POLICY_LOSSES)
    for key, build in (("algo.estimator", bind_estimator), ("algo.policy_loss", bind_policy_loss)):
        try:
            build(cfg)
        except ConfigError as e:
            raise ValueError(f"{key}: {e}") from None
    if a.loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"algo.loss_agg: unknown name '{a.loss_agg}'; valid: {', '.join(LOSS_AGGREGATIONS)}")
    if a.guidance != "none" and (cfg.env.max_turns > 1 or cfg.agent.entry):
        where = f"env.max_turns is {cfg.env.max_turns}" if cfg.env.max_turns > 1 else "agent.entry is set"
        raise ValueError(
            f"algo.guidance: '{a.guidance}' puts a reference solution into single-turn episodes of the "
            f"built-in driver; {where}"
        )


def _environments(cfg: RunConfig) -> list[type[Environment]]:
    """The built-in environments and the run's own (`env.plugins`), imported and checked now."""
    from tempering.envs import ENVIRONMENTS, environment_class

    plugins = []
    for spec in cfg.env.plugins:
        if ":" not in spec:
            raise ValueError(
                f"env.plugins: '{spec}' is not of the form 'package.module:Class' (built-in "
                f"environments need no listing: {', '.join(ENVIRONMENTS)})"
            )
        try:
            plugins.append(environment_class(spec))
        except ConfigError as e:
            raise ValueError(f"env.plugins: {e}") from None
    return [*ENVIRONMENTS.values(), *plugins]


def _check_rewards(cfg: RunConfig, environments: list[type[Environment]]) -> None:
    from tempering.rewards import PARTIAL, REWARD_COMPONENTS
    from tempering.rewards.guards import GUARDS
    from tempering.types import Task

    r = cfg.reward
    if r.weights is not None and not r.weights:
        raise ValueError("reward.weights: empty; name at least one component, e.g. {tests: 1.0}")
    weights = (
        r.weights
        if r.weights is not None
        else {name: 1.0 for env in environments for name in env.default_weights}
    )
    unknown = sorted(set(r.params) - set(weights))
    if unknown:
        raise ValueError(f"reward.params: {', '.join(unknown)} not in reward.weights ({', '.join(weights)})")
    env_components = {name for env in environments for name in env.components}
    if cfg.agent.reward != "env":
        env_components.add("agent")  # the reward an agent posts to its session (rollout.episodes)
    for name in weights:
        if name in env_components and name not in REWARD_COMPONENTS:
            if r.params.get(name):
                raise ValueError(f"reward.params.{name}: an environment component takes no params")
            continue
        key = f"reward.weights.{name}"
        params = r.params.get(name, {})
        if name.startswith("trl:"):
            # A TRL batch function gets the prompts, the completions and one column per task field.
            columns: dict[str, list] = {field: [] for field in Task.model_fields if field != "prompt"}
            _user_function(key, name[4:], "TRL reward function", prompts=[], completions=[], **columns)
            if params:
                raise ValueError(
                    f"reward.params.{name}: a TRL reward function takes no params (it gets the "
                    "task fields as columns)"
                )
            continue
        known = _known("reward.weights", name, {**REWARD_COMPONENTS, **dict.fromkeys(env_components)})
        fn = REWARD_COMPONENTS[name] if known else _import(key, name, "reward component")
        try:  # the call of RewardFunction.components: fn(task, trajectory, **reward.params[name])
            check_call(fn, name, "reward component", ARG, ARG, **params)
        except ConfigError as e:
            problem = _unknown_params(fn, params)
            raise ValueError(f"reward.params.{name}: {problem}" if problem else f"{key}: {e}") from None
        if name == "tests" and params.get("partial", "always") not in PARTIAL:
            raise ValueError(
                f"reward.params.tests.partial: '{params['partial']}'; valid: {', '.join(PARTIAL)}"
            )
    kinds = r.guard_kinds or []
    bad = [k for k in kinds if k not in GUARDS]
    if bad:
        raise ValueError(f"reward.guard_kinds: unknown guard(s) {', '.join(bad)}; valid: {', '.join(GUARDS)}")
    if r.step_fn is not None:
        # RewardFunction.step_scores: fn(task, steps).
        _user_function("reward.step_fn", r.step_fn, "step reward function", ARG, [])


def _unknown_params(fn: Any, params: dict[str, Any]) -> str | None:
    """'unknown parameter(s) x; accepted: a, b' when `params` names what `fn` does not take, else None."""
    import inspect

    parameters = list(inspect.signature(fn).parameters.values())[2:]  # after (task, trajectory)
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return None
    accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in params if k not in accepted]
    if not unknown:
        return None
    return f"unknown parameter(s) {', '.join(unknown)}; accepted: {', '.join(accepted) or 'none'}"


def _check_cross_fields(cfg: RunConfig) -> None:
    a, m = cfg.algo, cfg.model
    if a.kl_target is not None and a.kl_coef == 0:
        raise ValueError(
            "algo.kl_target: adaptive KL needs a starting algo.kl_coef > 0 (0 turns the KL term off)"
        )
    if m.name is not None:
        from tempering.models.registry import MODELS

        if m.name not in MODELS:
            raise ValueError(f"model.name: unknown model '{m.name}'; known: {', '.join(MODELS)}")
        if m.path is not None:
            raise ValueError("model.name and model.path both name a start model; set one")
    if m.path is None and m.name is None and m.hidden_size % m.num_heads:
        raise ValueError(
            f"model.hidden_size: {m.hidden_size} is not divisible by model.num_heads ({m.num_heads})"
        )
    import importlib.util

    for sink in ("wandb", "mlflow"):
        if getattr(cfg.tracking, sink) and importlib.util.find_spec(sink) is None:
            raise ValueError(f"tracking.{sink}: the '{sink}' package is not installed (pip install {sink})")
    url = cfg.sandbox.url
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"sandbox.url: '{url}' is not an http:// or https:// URL")
    _check_data(cfg)
    _check_distributed(cfg)
    _check_agent(cfg)


def _check_agent(cfg: RunConfig) -> None:
    """The agent is importable and takes (task, base_url, api_key), or its command exists; it runs on the
    local engine (the recording proxy serves it); an agent reward is weighted."""
    import shutil

    g = cfg.agent
    if g.entry and g.command:
        raise ValueError("agent.entry and agent.command both name the agent; set one")
    if g.entry:
        _user_function("agent.entry", g.entry, "agent", {}, "http://127.0.0.1/v1", "key")
    if g.command is not None and (not g.command or shutil.which(g.command[0]) is None):
        raise ValueError(f"agent.command: '{(g.command or [''])[0]}' is not an executable on PATH")
    if not (g.entry or g.command):
        return
    if cfg.rollout.engine != "local":
        raise ValueError("agent.entry: agents need rollout.engine: local (the recording proxy serves it)")
    if g.reward != "env" and cfg.reward.weights is not None and "agent" not in cfg.reward.weights:
        raise ValueError(f"reward.weights: agent.reward '{g.reward}' needs a weight for 'agent'")


def _check_data(cfg: RunConfig) -> None:
    d = cfg.data
    low, high = d.pass_range
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"data.pass_range: [{low}, {high}] is not a range within [0, 1]")
    if len(set(d.generators)) < len(d.generators) or not d.generators:
        raise ValueError(f"data.generator: name each generator once, got {d.generator}")
    code_only = {
        "templates": d.templates,
        "heldout_templates": d.heldout_templates,
        "describe": d.describe or None,
    }
    for key, value in code_only.items():
        if value is not None and "code" not in d.generators:
            raise ValueError(
                f"data.{key}: applies to the built-in code generator, not data.generator={d.generator}"
            )
    from tempering.data.generators import TEMPLATES

    for key in ("templates", "heldout_templates"):
        unknown = sorted(set(getattr(d, key) or ()) - {t.name for t in TEMPLATES})
        if unknown:
            raise ValueError(
                f"data.{key}: unknown template(s) {unknown}; valid: {', '.join(t.name for t in TEMPLATES)}"
            )
    from tempering.data.benchmarks import BENCHMARKS

    for name in cfg.eval.benchmarks:
        if name not in BENCHMARKS:
            raise ValueError(f"eval.benchmarks: unknown task set '{name}'; valid: {', '.join(BENCHMARKS)}")


def _check_distributed(cfg: RunConfig) -> None:
    ro, d = cfg.rollout, cfg.distributed
    if ro.shards > ro.prompts_per_step:
        raise ValueError(
            f"rollout.shards: {ro.shards} shards of {ro.prompts_per_step} prompts per step leave some "
            "empty; use at most rollout.prompts_per_step"
        )
    low, high = ro.min_workers or ro.workers, ro.max_workers or ro.workers
    if not low <= ro.workers <= high:
        raise ValueError(f"rollout.workers: {ro.workers} is outside [min_workers {low}, max_workers {high}]")
    if ro.max_staleness and cfg.algo.dynamic_sampling:
        raise ValueError(
            "rollout.max_staleness: asynchronous rollouts with algo.dynamic_sampling are not supported "
            "(a step's extra sampling rounds would need the older policy again); set one of them off"
        )
    if d.trainers > 1 and d.backend != "ray":
        raise ValueError(
            f"distributed.trainers: {d.trainers} data-parallel trainers run as Ray actors; set "
            "distributed.backend: ray (or trainers: 1)"
        )
    if d.backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed.backend: 'ray' needs the ray package (pip install 'tempering[ray]')"
            )
