"""Code with execution feedback."""

from tempering.envs import EnvContext, make_env
from tempering.envs.code import program_of


def test_feedback_shows_failing_examples_but_never_hidden_expected_values(tasks, sandbox):
    task = next(t for t in tasks[0] if t.metadata.get("template") == "affine")
    env = make_env(task, EnvContext(sandbox, max_turns=3))
    env.reset(task)
    body = task.metadata["body"]
    wrong = body.rsplit(" ", 1)[0] + f" {int(body.rsplit(' ', 1)[1]) + 1}\n"  # the constant off by one
    step = env.step(wrong)
    assert not step.done and step.observation.startswith("# feedback: ")
    example = task.examples[0]
    assert f"expected {example.output!r}" in step.observation
    shown = {repr(e.output) for e in task.examples}
    for test in task.tests:
        if repr(test.output) not in shown:
            assert f"expected {test.output!r}" not in step.observation
    assert "hidden tests fail" in step.observation
    fixed = env.step(body + "\n")
    assert fixed.done and fixed.success
    assert fixed.passed == 1.0 and fixed.rewards["improvement"] == 1.0 - step.passed
    assert fixed.attempt.exec_result.all_passed


def test_an_exception_comes_back_as_its_last_line(tasks, sandbox):
    task = tasks[0][0]
    env = make_env(task, EnvContext(sandbox, max_turns=2))
    env.reset(task)
    step = env.step("    return 1 // 0\n")
    assert "ZeroDivisionError" in step.observation and step.observation.count("ZeroDivisionError") == 1


def test_a_hacking_attempt_scores_nothing(tasks, sandbox):
    task = tasks[0][0]
    env = make_env(task, EnvContext(sandbox, max_turns=2))
    env.reset(task)
    step = env.step("    import os; os._exit(0)\n")
    assert step.passed == 0.0 and step.rewards["improvement"] == 0.0
    assert step.hacking == ("exit_before_tests",)


def test_program_of_accepts_a_body_a_whole_function_or_a_fenced_block(tasks):
    task = tasks[0][0]
    assert program_of(task, "    return 1\n") == task.prompt + "    return 1\n"
    whole = "def f(x):\n    return 1\n"
    assert program_of(task, whole) == whole
    assert program_of(task, f"Here:\n```python\n{whole}```\n") == whole


def test_hidden_check_assertions_are_not_shown(sandbox):
    from tempering.types import Task

    check = "def check(candidate):\n    assert candidate(2) == 4, f'got {candidate(2)}, want 4'\n"
    task = Task(id="sq", domain="d", prompt="def f(x):\n", entry_point="f", tests=[{"check": check}])
    env = make_env(task, EnvContext(sandbox, max_turns=2))
    env.reset(task)
    step = env.step("    return x + 1\n")
    assert "1 of 1 hidden tests fail" in step.observation and "want 4" not in step.observation


def test_hidden_stdout_is_never_shown(sandbox):
    from tempering.types import Task

    task = Task(
        id="io",
        domain="d",
        prompt="",
        examples=[{"stdin": "0\n", "stdout": "2\n"}],
        tests=[{"stdin": "5\n", "stdout": "37\n"}, {"stdin": "1\n", "stdout": "9\n"}],
    )
    env = make_env(task, EnvContext(sandbox, max_turns=2))
    env.reset(task)
    step = env.step("print(int(input()) * 7 + 1)\n")
    assert "37" not in step.observation and "9\\n" not in step.observation
    assert "expected stdout 2\\n, got 1" in step.observation  # the visible example, whole
    assert "2 of 2 hidden tests fail" in step.observation


def test_a_caught_attempt_that_passes_everything_is_rejected_not_a_crash(tasks):
    from tempering.types import ExecResult, TestResult

    class Forged:
        def run_tests_batch(self, items):
            return [
                ExecResult(
                    "ok",
                    tests=[TestResult(f"t{i}", True) for i in range(len(task.tests))],
                    flags=["patched_builtins"],
                )
                for task, _ in items
            ]

    task = tasks[0][0].model_copy(update={"examples": []})
    env = make_env(task, EnvContext(Forged(), max_turns=2))
    env.reset(task)
    step = env.step("    return 0\n")
    assert not step.done and step.observation == "# feedback: rejected (harness_tampering)\n"
    assert step.rewards == {"improvement": 0.0} and step.hacking == ("harness_tampering",)


def test_every_environment_context_cuts_feedback_at_the_runs_default():
    """A run's env.feedback_chars, `tempering eval --turns` and `tempering repair` build their contexts in
    different places; they showed 400, 600 and 400 characters of feedback by default."""
    from tempering.config import build_config
    from tempering.config_sections import FEEDBACK_CHARS
    from tempering.envs.base import env_context

    assert EnvContext(sandbox=None).feedback_chars == FEEDBACK_CHARS
    assert env_context(build_config({}), sandbox=None).feedback_chars == FEEDBACK_CHARS


def test_a_step_carries_its_outcome_as_typed_fields_and_info_only_extras(tasks, sandbox):
    task = tasks[0][0]
    env = make_env(task, EnvContext(sandbox, max_turns=2), group_id=5)
    env.reset(task)
    step = env.step(task.metadata["body"] + "\n")
    assert step.success and step.passed == 1.0 and step.hacking == ()
    assert step.attempt.group_id == 5 and step.attempt.exec_result.all_passed
    assert not {"success", "passed", "hacking", "attempt", "status"} & set(step.info)
    turn = step.as_turn("x", tokens=3)
    assert turn.success and turn.attempt is step.attempt and turn.status == "ok" and turn.tokens == 3


def test_the_code_env_scores_an_attempt_with_the_tests_reward_itself(tasks, sandbox, monkeypatch):
    """One test scorer: the step's `passed` (and so `improvement`) is what `rewards.tests_passed` returns."""
    import tempering.envs.code as code

    calls = []

    def spy(task, attempt, **params):
        calls.append(params)
        return 0.25

    monkeypatch.setattr(code, "tests_passed", spy)
    task = tasks[0][0]
    env = make_env(task, EnvContext(sandbox, max_turns=2, partial="never"))
    env.reset(task)
    step = env.step("    return 0\n")
    assert step.passed == 0.25 and step.rewards["improvement"] == 0.25 and calls == [{"partial": "never"}]
