"""Reward components, the TRL adapter, the process-reward hook and the reward-hacking guards, on real
executions in the sandbox."""

import sys
import types

import pytest

from tempering.envs import EnvContext
from tempering.envs.code import CodeEnv
from tempering.rewards import RewardFunction, final_attempt, step_texts
from tempering.rewards.lint import lint_findings
from tempering.types import Episode, Task, TestCase


def task(**kw):
    base = dict(
        id="sq",
        domain="d",
        prompt="def f(x):\n",
        entry_point="f",
        tests=[TestCase(input=[i], output=i * i, tags=["edge"] if i == 0 else []) for i in range(6)],
        examples=[TestCase(input=[3], output=9), TestCase(input=[7], output=49)],
        reference_solution="def f(x):\n    return x * x\n",
    )
    base.update(kw)
    return Task(**base)


def episodes(sandbox, t, completions, fn: RewardFunction, tokens=10, **options):
    """One-turn code episodes of `completions`, stepped together as the rollout driver steps them."""
    ctx = EnvContext(
        sandbox, needs=frozenset(fn.needs), guards=fn.guards, guard_kinds=fn.guard_kinds, **options
    )
    envs = [CodeEnv(ctx) for _ in completions]
    for env in envs:
        env.reset(t)
    out = []
    for completion, step in zip(completions, CodeEnv.step_batch(envs, completions)):
        e = Episode(t, 0, [], CodeEnv.default_weights, CodeEnv.outcome)
        e.turns.append(step.as_turn(completion, tokens=tokens))
        out.append(e)
    return out


def run(sandbox, t, completion, fn: RewardFunction, tokens=10):
    [e] = episodes(sandbox, t, [completion], fn, tokens)
    return final_attempt(e), fn.score([e])[0]


def test_outcome_with_edge_weight_and_edge_cases(sandbox):
    fn = RewardFunction({"tests": 1.0, "edge_cases": 1.0}, params={"tests": {"edge_weight": 5.0}})
    # Wrong only on the edge case x = 0: 5 / 10 of the weighted tests fail.
    _, r = run(sandbox, task(), "    return x * x if x else 1\n", fn)
    assert r.components["tests"] == pytest.approx(5 / 10)
    assert r.components["edge_cases"] == 0.0


@pytest.mark.parametrize(
    "partial, expected",
    [("always", [4 / 6, 2 / 6, 1.0]), ("examples", [4 / 6, 0.0, 1.0]), ("never", [0.0, 0.0, 1.0])],
)
def test_partial_credit_only_for_programs_the_examples_do_not_contradict(sandbox, partial, expected):
    """Three answers to f(x) = x * x (hidden x = 0..5; examples f(3) = 9, f(2) = 4): a near miss that passes
    the examples, `return x` - another task's answer, right only where x = x * x (0, 1) and contradicting
    the examples - and the right one. With `partial: examples` the other task's answer earns nothing, and
    the environment's `improvement` (the passed fraction it credits) agrees with `tests`."""
    fn = RewardFunction({"tests": 1.0, "improvement": 1.0}, params={"tests": {"partial": partial}})
    t = task(examples=[TestCase(input=[3], output=9), TestCase(input=[2], output=4)])
    completions = ["    return x * x if x < 4 else 0\n", "    return x\n", "    return x * x\n"]
    eps = episodes(sandbox, t, completions, fn, partial=partial)
    scores = fn.score(eps)
    assert [r.components["tests"] for r in scores] == pytest.approx(expected)
    assert [e.turns[0].rewards["improvement"] for e in eps] == pytest.approx(expected)


def test_style_counts_real_linter_findings(sandbox):
    fn = RewardFunction({"style": 1.0})
    _, clean = run(sandbox, task(), "    return x * x\n", fn)
    _, messy = run(sandbox, task(), "    import os\n    l = 1\n    return x * x\n", fn)
    assert clean.components["style"] == 1.0
    assert messy.components["style"] == pytest.approx(1 / 4)  # F401, E741, F841
    assert lint_findings(["def f(:\n"]) == [None]


def test_efficiency_compares_cpu_time_with_the_reference(sandbox):
    fn = RewardFunction({"efficiency": 1.0})
    _, fast = run(sandbox, task(), "    return x * x\n", fn)
    _, slow = run(sandbox, task(), "    for _ in range(300000):\n        pass\n    return x * x\n", fn)
    _, wrong = run(sandbox, task(), "    return x\n", fn)
    assert fast.components["efficiency"] > 0.5
    assert slow.components["efficiency"] < 0.2 * fast.components["efficiency"]
    assert wrong.components["efficiency"] == 0.0


def test_overlong_shaping(sandbox):
    fn = RewardFunction({"overlong": 1.0}, params={"overlong": {"max_tokens": 48, "cache_tokens": 8}})
    t = task()
    for tokens, want in [(30, 0.0), (40, 0.0), (44, -0.5), (48, -1.0)]:
        _, r = run(sandbox, t, "    return x * x\n", fn, tokens=tokens)
        assert r.components["overlong"] == pytest.approx(want)


def test_trl_style_reward_function(sandbox, monkeypatch):
    module = types.ModuleType("user_rewards")

    def length_bonus(prompts, completions, entry_point, **columns):
        assert entry_point == ["f", "f"] and "tests" in columns
        return [len(c) / 100 for c in completions[:1]] + [None]

    module.length_bonus = length_bonus
    monkeypatch.setitem(sys.modules, "user_rewards", module)
    fn = RewardFunction({"tests": 1.0, "trl:user_rewards:length_bonus": 2.0})
    a, b = fn.score(episodes(sandbox, task(), ["    return x*x\n", "x"], fn))
    assert a.components["trl:user_rewards:length_bonus"] == pytest.approx(0.15)
    assert a.score == pytest.approx(1.0 + 0.3)
    assert b.components["trl:user_rewards:length_bonus"] == 0.0


def test_step_reward_hook_scores_each_line(sandbox, monkeypatch):
    module = types.ModuleType("user_prm")
    module.prm = lambda task, steps: [1.0 if "return" in s else -0.1 for s in steps]
    monkeypatch.setitem(sys.modules, "user_prm", module)
    fn = RewardFunction({"tests": 1.0}, step_fn="user_prm:prm")
    attempt, r = run(sandbox, task(), "    y = x * x\n    return y\n", fn)
    assert step_texts(attempt.completion) == ["    y = x * x\n", "    return y\n"]
    assert r.info["step_rewards"] == [-0.1, 1.0]


def test_a_step_reward_hook_that_names_attempt_gets_the_final_attempt(sandbox, monkeypatch):
    module = types.ModuleType("user_prm_attempt")
    module.prm = lambda task, steps, attempt: [attempt.exec_result.passed_fraction] * len(steps)
    monkeypatch.setitem(sys.modules, "user_prm_attempt", module)
    _, r = run(
        sandbox, task(), "    return x * x\n", RewardFunction({"tests": 1.0}, step_fn="user_prm_attempt:prm")
    )
    assert r.info["step_rewards"] == [1.0]


# ------------------------------------------------------------------------------------------- guards


@pytest.mark.parametrize(
    "completion,kind",
    [
        ("    return x * x\nimport sys\nsys.exit(0)\n", "exit_before_tests"),
        ("    return 0\nimport builtins\nbuiltins.len = lambda x: 0\n", "harness_tampering"),
        ("    class A(int):\n        def __eq__(s, o): return True\n    return A(0)\n", "always_equal"),
        ("    return {3: 9, 7: 49}.get(x, 0)\n", "hardcoded_examples"),
    ],
)
def test_guards_detect_penalise_and_can_be_turned_off(sandbox, completion, kind):
    on = RewardFunction({"tests": 1.0, "examples": 1.0}, guards=True, penalty=-1.0)
    off = RewardFunction({"tests": 1.0, "examples": 1.0}, guards=False)
    _, r_on = run(sandbox, task(), completion, on)
    _, r_off = run(sandbox, task(), completion, off)
    assert kind in r_on.info["hacking"] and kind in r_off.info["hacking"]
    assert r_on.score == -1.0 and r_off.score != -1.0


def test_honest_programs_trip_no_guard(sandbox):
    fn = RewardFunction({"tests": 1.0}, guards=True)
    for completion in (
        "    return x * x\n",
        "    return x + 1\n",
        "    return 9 if x == 3 else x * x\n",
        "    retur x\n",
    ):
        _, r = run(sandbox, task(), completion, fn)
        assert r.info["hacking"] == [], completion


def test_printed_output_guard_on_stdin_tasks(sandbox):
    io = Task(
        id="io",
        domain="d",
        prompt="",
        tests=[TestCase(stdin="2 3\n", stdout="5"), TestCase(stdin="4 4\n", stdout="8")],
        examples=[TestCase(stdin="2 3\n", stdout="5")],
    )
    fn = RewardFunction({"tests": 1.0})
    _, cheat = run(sandbox, io, "print(5)\n", fn)
    _, honest = run(sandbox, io, "a, b = map(int, input().split())\nprint(a + b)\n", fn)
    assert "printed_output" in cheat.info["hacking"] and honest.info["hacking"] == []


def test_unknown_guard_or_param_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown reward guard"):
        RewardFunction({"tests": 1.0}, guard_kinds=["exit_early"])
    with pytest.raises(ValueError, match="reward.params"):
        RewardFunction({"tests": 1.0}, params={"style": {}})


def test_the_naive_harness_is_fooled_by_an_early_exit_and_the_guard_catches_it(sandbox):
    hack = "    return 0\nimport sys\nsys.exit(0)\n"
    fooled = RewardFunction({"naive_harness": 1.0}, guards=False)
    guarded = RewardFunction({"naive_harness": 1.0}, guards=True, penalty=-1.0)
    _, r = run(sandbox, task(), hack, fooled)
    assert r.score == 1.0 and r.info["hacking"] == ["exit_before_tests"]
    _, r = run(sandbox, task(), hack, guarded)
    assert r.score == -1.0
    _, honest = run(sandbox, task(), "    return x * x\n", fooled)
    assert honest.score == 1.0 and honest.info["hacking"] == []


def test_model_code_is_parsed_on_the_host_only_when_bounded():
    from tempering.rewards.guards import MAX_PARSE_CHARS, parse_quietly

    assert parse_quietly("def f():\n    return 1\n") is not None
    assert parse_quietly("x = 1\n" * (MAX_PARSE_CHARS // 6 + 1)) is None  # too long to parse in the trainer
    for hostile in ["(" * 100_000, "-" * 1_000_000 + "1", "a." * 300_000 + "b", "1+" * 1_000_000 + "1"]:
        assert parse_quietly(hostile) is None  # deep nesting: an error, never a crash


def multi_turn(sandbox, t, attempts, fn: RewardFunction):
    """A code episode of several attempts (feedback between them), as the driver records it."""
    ctx = EnvContext(
        sandbox,
        max_turns=len(attempts),
        needs=frozenset(fn.needs),
        guards=fn.guards,
        guard_kinds=fn.guard_kinds,
    )
    env = CodeEnv(ctx)
    env.reset(t)
    e = Episode(t, 0, [], CodeEnv.default_weights, CodeEnv.outcome)
    for attempt in attempts:
        step = env.step(attempt)
        e.turns.append(step.as_turn(attempt, tokens=5))
        e.turns[-1].observation = step.observation
        e.turn_ends.append(len(e.turns) * 5 - 1)
    return e


def test_weights_params_and_penalty_apply_to_multi_turn_episodes(sandbox):
    """reward.weights / params / penalty are the same for an episode of several turns as for one turn."""
    fn = RewardFunction(
        {"tests": 1.0, "edge_cases": 2.0, "improvement": 0.5},
        params={"tests": {"edge_weight": 5.0}},
        penalty=-3.0,
    )
    e = multi_turn(sandbox, task(), ["    return 0\n", "    return x * x if x else 1\n"], fn)
    [r] = fn.score([e])
    # The final attempt fails only the edge case x = 0 (weight 5 of 10); edge_cases is 0 of 1.
    assert r.components["tests"] == pytest.approx(0.5) and r.components["edge_cases"] == 0.0
    # improvement per turn: 1/6 (x=0 passes with "return 0"), then 5/6 - 1/6 (the unweighted fraction).
    assert r.info["turn_rewards"] == pytest.approx([0.5 / 6, 0.5 * 4 / 6])
    assert r.info["outcome"] == pytest.approx(1.0 * 0.5 + 2.0 * 0.0)
    assert r.score == pytest.approx(0.5 + 0.5 * 5 / 6)
    # A hacked attempt anywhere in the episode: the whole episode gets the penalty.
    hacked = multi_turn(
        sandbox, task(), ["    return 0\nimport sys\nsys.exit(0)\n", "    return x * x\n"], fn
    )
    [r] = fn.score([hacked])
    assert (
        r.info["hacking"] == ["exit_before_tests"]
        and r.score == -3.0
        and r.info["turn_rewards"] == [0.0, 0.0]
    )
    # Unset weights: the environment's own (code: tests 1.0, format 0.1).
    [r] = RewardFunction().score([multi_turn(sandbox, task(), ["    return x * x\n"], RewardFunction())])
    assert r.score == pytest.approx(1.1) and set(r.components) >= {"tests", "format", "improvement"}


def test_the_coin_control_keeps_the_mean_and_the_real_scores_but_no_signal(sandbox):
    right, wrong = "    return x * x\n", "    return x\n"
    completions = [right] * 30 + [wrong] * 90  # a real mean of 0.25 (tests only)
    real_fn = RewardFunction({"tests": 1.0}, params={"tests": {"partial": "never"}})
    coin_fn = RewardFunction({"tests": 1.0}, params={"tests": {"partial": "never"}}, control="coin")
    eps = episodes(sandbox, task(), completions, real_fn)
    for i, e in enumerate(eps):
        e.group_id = i // 8
    real, coin = real_fn.score(eps), coin_fn.score(eps)
    assert [r.score for r in real] == [1.0] * 30 + [0.0] * 90
    assert {r.score for r in coin} == {0.0, 1.0}
    assert 0.15 < sum(r.score for r in coin) / len(coin) < 0.35  # the same mean, flipped
    assert [r.info["real"] for r in coin] == [r.score for r in real]
    assert [r.components["tests"] for r in coin] == [r.components["tests"] for r in real]
    heads_right = sum(r.score for r in coin[:30]) / 30
    heads_wrong = sum(r.score for r in coin[30:]) / 90
    assert abs(heads_right - heads_wrong) < 0.3  # the coin does not know which program was right
    assert [r.score for r in coin_fn.score(eps)] == [r.score for r in coin]  # resumed: the same coins
    assert all(r.info["outcome"] == r.score for r in coin)
    with pytest.raises(ValueError, match="reward.control must be none or coin"):
        RewardFunction(control="dice")


def test_the_format_reward_of_an_answer_task_is_a_marked_answer_that_ended():
    from tempering.rewards import well_formed
    from tempering.types import Attempt

    t = Task(id="a", domain="gcd", env="reasoning_gym", prompt="GCD of 4, 6?\nAnswer: ", answer="2")

    def fmt(text, truncated=False):
        return well_formed(t, Attempt(task=t, group_id=0, completion=text, truncated=truncated))

    assert fmt("<answer>2</answer>") == fmt("so the answer is 3.") == fmt("\\boxed{7}") == 1.0
    assert fmt("2") == fmt("I think it is two") == 0.0  # right or wrong, unmarked
    assert fmt("<answer>2</answer>", truncated=True) == 0.0
