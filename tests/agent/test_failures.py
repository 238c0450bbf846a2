"""Failure classification on real failing programs, executed in the sandbox, one per class."""

import pytest

from tempering.agent.failures import classify
from tempering.envs.code import split_examples, with_examples
from tempering.rewards.guards import detect
from tempering.types import Attempt, Task, TestCase

TASK = Task(
    id="inc",
    domain="d",
    prompt="def inc(x):\n",
    entry_point="inc",
    tests=[TestCase(input=[1], output=2), TestCase(input=[0], output=1)],
    examples=[TestCase(input=[3], output=4)],
)

PROGRAMS = {
    "passed": ("def inc(x):\n    return x + 1\n", "all 2 tests pass"),
    "syntax_error": ("def inc(x):\n    return (x +\n", "SyntaxError"),
    "runtime_error": ("def inc(x):\n    return 1 // (x - x) + x\n", "ZeroDivisionError"),
    "wrong_answer": ("def inc(x):\n    return x + 2\n", "f(3) returned 5, expected 4"),
    "timeout": ("def inc(x):\n    while True:\n        pass\n", "timed out"),
    "memory": ("def inc(x):\n    a = [0] * (10 ** 10)\n    return x + 1\n", "MemoryError"),
    "output_limit": ("import sys\nsys.stdout.write('x' * (64 << 20))\ndef inc(x):\n    return x + 1\n", ""),
}


@pytest.fixture(scope="module")
def results(sandbox):
    runs = sandbox.run_tests_batch([(with_examples(TASK), code) for code, _ in PROGRAMS.values()])
    return dict(zip(PROGRAMS, runs))


@pytest.mark.parametrize("kind", list(PROGRAMS))
def test_each_class_on_a_real_program(results, kind):
    hidden, examples = split_examples(results[kind], len(TASK.tests))
    failure = classify(hidden, examples)
    assert failure.kind == kind, (failure, results[kind].status)
    assert PROGRAMS[kind][1] in failure.message
    assert failure.hidden_total == 2
    assert failure.hidden_failed == (0 if kind == "passed" else 2)


def test_wrong_answers_show_visible_examples_only(results):
    hidden, examples = split_examples(results["wrong_answer"], len(TASK.tests))
    failure = classify(hidden, examples)
    assert failure.visible == ["f(3) returned 5, expected 4"]  # input, actual, expected of the example
    assert "expected 2" not in str(failure.to_json()) and "expected 1" not in str(failure.to_json())


def test_a_program_that_dies_at_import_keeps_its_traceback(sandbox):
    code = "import no_such_module_here\ndef inc(x):\n    return x + 1\n"
    [result] = sandbox.run_tests_batch([(TASK, code)])
    failure = classify(result)
    assert failure.kind == "runtime_error"
    assert (
        failure.message == "ModuleNotFoundError: No module named 'no_such_module_here'"
    )  # the cause, not the harness
    assert "Traceback" in failure.traceback and "line 1" in failure.traceback


def test_a_long_traceback_keeps_head_and_tail(sandbox):
    code = "def boom(n):\n    return boom(n + 1) if n < 60 else 1 / 0\nboom(0)\ndef inc(x):\n    return x\n"
    [result] = sandbox.run_tests_batch([(TASK, code)])
    failure = classify(result, traceback_chars=300)
    assert failure.kind == "runtime_error" and failure.message.startswith("ZeroDivisionError")
    assert len(failure.traceback) < 340 and "chars cut" in failure.traceback  # the limit, and the cut marker
    assert failure.traceback.startswith("Traceback") and "ZeroDivisionError" in failure.traceback[-120:]


def test_a_guarded_hack_is_rejected(sandbox):
    code = "def inc(x):\n    return {3: 4}.get(x, 0)\n"  # writes the visible example's answer literally
    [result] = sandbox.run_tests_batch([(with_examples(TASK), code)])
    hidden, examples = split_examples(result, len(TASK.tests))
    hacks = detect(
        TASK,
        Attempt(TASK, 0, code.removeprefix(TASK.prompt), False, exec_result=hidden, example_result=examples),
    )
    assert hacks == ["hardcoded_examples"]
    assert classify(hidden, examples, hacks).kind == "rejected"


@pytest.mark.parametrize(
    "kind, program",
    [
        ("timeout", "def inc(x):\n    while x == 1:\n        pass\n    return x + 5\n"),
        ("memory", "def inc(x):\n    if x == 1:\n        a = [0] * (10 ** 10)\n    return x + 5\n"),
    ],
)
def test_timeouts_and_memory_errors_never_name_a_hidden_test(sandbox, kind, program):
    """The first hidden test returns a wrong value (its message would name input 7 and expected 8), the
    second dies: the failure's text names neither - hidden tests are only counted."""
    task = Task(
        id="inc",
        domain="d",
        prompt="def inc(x):\n",
        entry_point="inc",
        tests=[TestCase(input=[7], output=8), TestCase(input=[1], output=2)],
    )
    [result] = sandbox.run_tests_batch([(task, program)])
    failure = classify(result)
    assert failure.kind == kind, failure
    text = str(failure.to_json())
    assert "expected" not in text and "f(7)" not in text and "12" not in text, text
