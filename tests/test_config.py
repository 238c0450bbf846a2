import re

import pytest

from tempering.config import RunConfig, build_config, load_config, parse_override
from tempering.errors import ConfigError


def test_defaults_and_dotted_overrides():
    cfg = build_config({}, ["algo.lr=3e-5", "run.dir=runs/x", "data.domains=[loops, strings]", "sft.steps=0"])
    assert cfg.algo.lr == 3e-5 and cfg.run.dir == "runs/x"
    assert cfg.data.domains == ["loops", "strings"] and cfg.sft.steps == 0
    assert cfg.rollout.group_size == RunConfig().rollout.group_size


def test_override_beats_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  lr: 0.5\n  clip_ratio: 0.3\n")
    cfg = load_config(path, ["algo.lr=0.25"])
    assert cfg.algo.lr == 0.25 and cfg.algo.clip_ratio == 0.3


def test_unknown_key_in_override_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        build_config({}, ["algo.lrr=1e-4"])
    msg = str(e.value)
    assert "'algo.lrr'" in msg and "lr" in msg and "clip_ratio" in msg


def test_unknown_section_and_file_key(tmp_path):
    with pytest.raises(
        ConfigError, match="unknown config key 'trainer'.*valid keys under the top level: run"
    ):
        build_config({}, ["trainer.steps=3"])
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match="'rollout.group_sise'.*group_size"):
        load_config(path)


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="config key 'algo.lr'.*got 'fast'"):
        build_config({}, ["algo.lr=fast"])
    with pytest.raises(ConfigError, match="config key 'train.steps'"):
        build_config({"train": {"steps": [1, 2]}})


def test_unknown_registry_name_lists_valid_ones():
    with pytest.raises(ConfigError, match="algo.estimator: unknown name 'gae2'; valid: grpo"):
        build_config({}, ["algo.estimator=gae2"])
    with pytest.raises(ConfigError, match="reward.weights: unknown name 'speed'"):
        build_config({}, ["reward.weights={speed: 1.0}"])
    # User code is named as package.module:function, imported and signature-checked at load time.
    spec = "tempering.algos.advantages:rloo"
    assert build_config({}, [f"algo.estimator={spec}"]).algo.estimator == spec


def test_value_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="'algo.lr' is a value, not a section"):
        build_config({}, ["algo.lr.x=1"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("algo.lr")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_yaml_round_trip(tmp_path):
    cfg = build_config({}, ["algo.lr=2e-4", "reward.weights={tests: 1.0}"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg
    assert load_config(tmp_path) == cfg  # a run directory works too


# Each of these was accepted at load time and failed minutes later (after SFT and the held-out evaluation),
# or was silently ignored. Each must now fail in load_config with a message that starts with / names the key.
BAD_VALUES = [
    (
        {"reward": {"params": {"tests": {"edge_wieght": 2.0}}}},
        "reward.params.tests: unknown parameter(s) edge_wieght",
    ),
    (
        {"reward": {"params": {"overlong": {"max_tokens": 8}}}},
        "reward.params: overlong not in reward.weights",
    ),
    (
        {"reward": {"weights": {"overlong": 1.0}, "params": {"overlong": {"max_token": 8}}}},
        "reward.params.overlong: unknown parameter(s) max_token; accepted: max_tokens, cache_tokens",
    ),
    (
        {
            "reward": {
                "weights": {"tempering.rewards:tests_passed": 1.0},
                "params": {"tempering.rewards:tests_passed": {"edge": 2}},
            }
        },
        "reward.params.tempering.rewards:tests_passed: unknown parameter(s) edge",
    ),
    ({"reward": {"weights": {}}}, "reward.weights: empty"),
    ({"reward": {"guard_kinds": ["always_equals"]}}, "reward.guard_kinds: unknown guard(s) always_equals"),
    (
        {"algo": {"estimator": "no_such_pkg.adv:fn"}},
        "algo.estimator: advantage estimator 'no_such_pkg.adv:fn': cannot import module",
    ),
    ({"algo": {"estimator": "tempering.algos.advantages:nope"}}, "algo.estimator: .* has no callable 'nope'"),
    ({"algo": {"estimator": "os:getcwd"}}, "algo.estimator: advantage estimator 'os:getcwd' cannot take"),
    (
        {"algo": {"policy_loss": "tempering.rewards:tests_passed"}},
        "algo.policy_loss: policy loss .* cannot take",
    ),
    ({"reward": {"weights": {"no_such_pkg:fn": 1.0}}}, "reward.weights.no_such_pkg:fn: reward component"),
    (
        {"reward": {"weights": {"os:getcwd": 1.0}}},
        "reward.weights.os:getcwd: reward component 'os:getcwd' cannot",
    ),
    ({"reward": {"weights": {"trl:os:getcwd": 1.0}}}, "reward.weights.trl:os:getcwd: TRL reward function"),
    ({"reward": {"step_fn": "no_such_pkg:fn"}}, "reward.step_fn: step reward function 'no_such_pkg:fn'"),
    ({"reward": {"step_fn": "os:getcwd"}}, "reward.step_fn: step reward function 'os:getcwd' cannot take"),
    ({"checkpoint": {"every": 0}}, "'checkpoint.every'"),
    ({"algo": {"max_sampling_rounds": 0}}, "'algo.max_sampling_rounds'"),
    ({"rollout": {"temperature": 0}}, "'rollout.temperature'"),
    ({"algo": {"clip_ratio_c": 1.0}}, "'algo.clip_ratio_c': Input should be greater than 1"),
    ({"algo": {"clip_ratio_c": 0.5}}, "'algo.clip_ratio_c'"),
    ({"rollout": {"prompts_per_step": 0}}, "'rollout.prompts_per_step'"),
    ({"env": {"max_context": -1}}, "'env.max_context'"),
    (
        {"reward": {"weights": {"improvement": 1.0}, "params": {"improvement": {"x": 1}}}},
        "reward.params.improvement: an environment component takes no params",
    ),
    ({"env": {"options": {"flaky_failure_rat": 0.5}}}, "'env.options.flaky_failure_rat'.*flaky_failure_rate"),
    ({"env": {"options": {"flaky_failure_rate": 1.5}}}, "'env.options.flaky_failure_rate'"),
    # The audit: sizes that must be positive, probabilities and fractions in [0, 1], cross-field rules.
    ({"rollout": {"group_size": 0}}, "'rollout.group_size'"),
    ({"rollout": {"top_p": 0}}, "'rollout.top_p'"),
    ({"rollout": {"top_p": 1.5}}, "'rollout.top_p'"),
    ({"rollout": {"max_new_tokens": 0}}, "'rollout.max_new_tokens'"),
    ({"algo": {"minibatches": 0}}, "'algo.minibatches'"),
    ({"algo": {"ppo_epochs": 0}}, "'algo.ppo_epochs'"),
    ({"algo": {"lr": 0}}, "'algo.lr'"),
    ({"algo": {"gamma": 1.5}}, "'algo.gamma'"),
    ({"algo": {"lam": -0.1}}, "'algo.lam'"),
    ({"algo": {"clip_ratio": 1.0}}, "'algo.clip_ratio'"),
    ({"algo": {"clip_ratio_low": 0}}, "'algo.clip_ratio_low'"),
    ({"algo": {"kl_coef": -0.1}}, "'algo.kl_coef'"),
    ({"algo": {"kl_target": 0.1}}, "algo.kl_target: adaptive KL needs"),
    ({"algo": {"kl_horizon": 0}}, "'algo.kl_horizon'"),
    ({"algo": {"max_grad_norm": 0}}, "'algo.max_grad_norm'"),
    ({"algo": {"critic": {"epochs": 0}}}, "'algo.critic.epochs'"),
    ({"sft": {"batch_size": 0}}, "'sft.batch_size'"),
    ({"sft": {"steps": -1}}, "'sft.steps'"),
    ({"sft": {"repair_fraction": 1.5}}, "'sft.repair_fraction'"),
    ({"data": {"num_heldout": 0}}, "'data.num_heldout'"),
    ({"data": {"sft_fraction": 0}}, "'data.sft_fraction'"),
    (
        {"model": {"hidden_size": 30, "num_heads": 4}},
        "model.hidden_size: 30 is not divisible by model.num_heads",
    ),
    ({"model": {"num_layers": 0}}, "'model.num_layers'"),
    ({"run": {"threads": 0}}, "'run.threads'"),
    ({"env": {"max_turns": 0}}, "'env.max_turns'"),
    ({"env": {"feedback_chars": 10}}, "'env.feedback_chars'"),
    ({"sandbox": {"timeout_s": 0}}, "'sandbox.timeout_s'"),
    ({"sandbox": {"workers": 0}}, "'sandbox.workers'"),
    ({"sandbox": {"memory_mb": 0}}, "'sandbox.memory_mb'"),
    ({"sandbox": {"url": "localhost:8080"}}, "sandbox.url: 'localhost:8080' is not an http"),
    ({"train": {"steps": -1}}, "'train.steps'"),
    ({"train": {"max_time_s": 0}}, "'train.max_time_s'"),
    ({"checkpoint": {"keep": 0}}, "'checkpoint.keep'"),
    ({"checkpoint": {"keep_every": 0}}, "'checkpoint.keep_every'"),
    ({"eval": {"samples": 0}}, "'eval.samples'"),
    ({"eval": {"val_tasks": 0}}, "'eval.val_tasks'"),
    ({"eval": {"temperature": 0}}, "'eval.temperature'"),
    ({"eval": {"every": -1}}, "'eval.every'"),
    ({"tracking": {"samples_every": -1}}, "'tracking.samples_every'"),
    ({"rollout": {"shards": 5, "prompts_per_step": 4}}, "rollout.shards: 5 shards of 4 prompts"),
    ({"rollout": {"max_staleness": -1}}, "'rollout.max_staleness'"),
    (
        {"rollout": {"max_staleness": 1}, "algo": {"dynamic_sampling": True}},
        "rollout.max_staleness: asynchronous",
    ),
    ({"algo": {"correction": "is"}}, "'algo.correction'"),
    ({"algo": {"correction_cap": 0}}, "'algo.correction_cap'"),
    ({"distributed": {"backend": "dask"}}, "'distributed.backend'"),
    (
        {"rollout": {"workers": 3, "max_workers": 2}},
        "rollout.workers: 3 is outside [min_workers 3, max_workers 2]",
    ),
    ({"distributed": {"trainers": 2}}, "distributed.trainers: 2 data-parallel trainers run as Ray actors"),
    ({"distributed": {"trainers": 0}}, "'distributed.trainers'"),
    ({"reward": {"params": {"tests": {"partial": "sometimes"}}}}, "reward.params.tests.partial: 'sometimes'"),
    ({"data": {"pass_range": [0.6, 0.2]}}, "data.pass_range: [0.6, 0.2] is not a range within [0, 1]"),
    ({"data": {"templates": ["add", "nope"]}}, "data.templates: unknown template(s) ['nope']"),
    (
        {"data": {"generator": "leetcode", "describe": True}},
        "data.describe: applies to the built-in code generator",
    ),
    (
        {"eval": {"benchmarks": ["humaneval", "mbpp"]}},
        "eval.benchmarks: unknown task set 'mbpp'; valid: humaneval",
    ),
]


def _first_key(tree) -> str:
    key, value = next(iter(tree.items()))
    return f"{key}.{_first_key(value)}" if isinstance(value, dict) and value else str(key)


@pytest.mark.parametrize("tree, message", BAD_VALUES, ids=[_first_key(t) for t, _ in BAD_VALUES])
def test_bad_value_fails_at_load_time_naming_the_key(tree, message):
    with pytest.raises(ConfigError, match=message if ".*" in message else re.escape(message)) as e:
        build_config(tree)
    assert "\n" not in str(e.value)


def test_user_functions_that_fit_are_accepted():
    """`package.module:function` names that import and take the run's call pass (checked, not just parsed)."""
    cfg = build_config(
        {
            "algo": {
                "estimator": "tempering.algos.advantages:grpo",
                "policy_loss": "tempering.algos.losses:vanilla_pg_loss",
            },
            "reward": {
                "weights": {"tempering.rewards:tests_passed": 1.0, "overlong": 0.5, "tool_error": -0.5},
                "params": {
                    "tempering.rewards:tests_passed": {"edge_weight": 2.0},
                    "overlong": {"max_tokens": 8},
                },
                "step_fn": "tests.test_config:step_scores",
            },
            "env": {"options": {"flaky_failure_rate": 0.25}},
        }
    )
    assert (
        cfg.env.options.flaky_failure_rate == 0.25 and cfg.reward.step_fn == "tests.test_config:step_scores"
    )


def step_scores(task, steps):
    """A process-reward hook of the documented shape, named by the test above."""
    return [0.0 for _ in steps]


def test_user_module_that_raises_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_reward.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="reward.weights.broken_reward:fn: .*RuntimeError: boom"):
        build_config({"reward": {"weights": {"broken_reward:fn": 1.0}}})


def test_every_shipped_recipe_loads(monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "examples" / "agents"))  # as `make agent-proxy` runs its recipe
    recipes = sorted((root / "configs").rglob("*.yaml"))
    assert len(recipes) >= 10
    for path in recipes:
        load_config(path)


@pytest.mark.parametrize(
    "override", ["sandbox.timeout_s=.inf", "sandbox.cpu_s=.nan", "algo.lr=nan", "train.max_time_s=inf"]
)
def test_a_nan_or_infinite_value_is_a_config_error_naming_the_key(override):
    """A NaN deadline reached the sandbox's wait (an HTTP 500 there, a refused execution here) only at the
    first step; it is refused when the config loads."""
    with pytest.raises(ConfigError, match=f"config key '{override.split('=')[0]}'.*finite number") as e:
        build_config({}, [override])
    assert "\n" not in str(e.value)
