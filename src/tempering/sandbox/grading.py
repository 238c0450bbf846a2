"""Test verdicts, decided in the caller's process: how a task's hidden tests become executions
(`test_requests`), and how the programs' raw answers become one verdict per test (`grade`). Expected
outputs never leave this process: a worker returns only what the program produced, and `compare_values`
decides here.
"""

from __future__ import annotations

import ast
import math
from dataclasses import replace
from typing import Any

from tempering.sandbox.execution import ExecRequest, SandboxLimits, to_result
from tempering.types import ExecResult, Task, TestCase, TestResult


def test_requests(task: Task, code: str, limits: SandboxLimits) -> list[ExecRequest]:
    """Function-call tasks: one execution calls the entry point on every input. stdin tasks: one per case."""
    if task.tests[0].is_call:
        calls = [list(t.input) for t in task.tests]
        return [
            ExecRequest(
                code=code, language=task.language, entry_point=task.entry_point, calls=calls, limits=limits
            )
        ]
    if task.tests[0].is_check:
        checks = [t.check for t in task.tests]
        return [
            ExecRequest(
                code=code, language=task.language, entry_point=task.entry_point, checks=checks, limits=limits
            )
        ]
    return [ExecRequest(code=code, language=task.language, stdin=t.stdin, limits=limits) for t in task.tests]


def grade(task: Task, raw: list[dict[str, Any]]) -> ExecResult:
    """Turn worker responses for a task into one ExecResult with a verdict per hidden test."""
    if task.tests[0].is_call or task.tests[0].is_check:
        result = to_result(raw[0])
        calls = raw[0].get("calls") or [None] * len(task.tests)
        grade_one = _grade_call if task.tests[0].is_call else _grade_check
        result.tests = [grade_one(i, t, c, result) for i, (t, c) in enumerate(zip(task.tests, calls))]
        return result
    results = [to_result(r) for r in raw]
    tests = []
    for i, (t, r) in enumerate(zip(task.tests, results)):
        name = t.name or f"test_{i}"
        if r.status != "ok":
            tests.append(TestResult(name, False, f"{r.status}: {_tail(r.stderr)}"))
        elif normalize_stdout(r.stdout) == normalize_stdout(t.stdout or ""):
            tests.append(TestResult(name, True))
        else:
            tests.append(
                TestResult(name, False, f"expected stdout {_short(t.stdout)}, got {_short(r.stdout)}")
            )
    worst = next((r for r in results if r.status != "ok"), results[0])
    merged = replace(worst, tests=tests, flags=sorted({f for r in results for f in r.flags}))
    merged.wall_time_s = sum(r.wall_time_s for r in results)
    merged.cpu_time_s = sum(r.cpu_time_s for r in results)
    merged.max_rss_mb = max(r.max_rss_mb for r in results)
    return merged


def _no_result(name: str, result: ExecResult) -> TestResult:
    why = {"timeout": "timed out", "memory_limit": "out of memory", "output_limit": "output limit"}.get(
        result.status, "the program ended before this test ran"
    )
    return TestResult(
        name, False, f"no result: {why}" + (f"\n{_tail(result.stderr)}" if result.stderr else "")
    )


def _grade_check(i: int, test: TestCase, verdict: dict[str, Any] | None, result: ExecResult) -> TestResult:
    """check() tests: the verdict was decided by the checker process, which never ran the program's code."""
    name = test.name or f"test_{i}"
    if verdict is None:
        return _no_result(name, result)
    return TestResult(
        name, bool(verdict.get("ok")), None if verdict.get("ok") else verdict.get("error", "failed")
    )


def _grade_call(i: int, test: TestCase, call: dict[str, Any] | None, result: ExecResult) -> TestResult:
    name = test.name or f"test_{i}"
    if call is None:
        return _no_result(name, result)
    if not call.get("ok"):
        return TestResult(name, False, call.get("error", "error"))
    try:
        actual = parse_value(call["value"])
    except ValueError:
        return TestResult(
            name, False, f"returned a value that is not a plain literal: {_short(call['value'])}"
        )
    if compare_values(actual, test.output):
        return TestResult(name, True)
    args = ", ".join(map(repr, test.input or []))
    return TestResult(name, False, f"f({args}) returned {_short(call['value'])}, expected {test.output!r}")


MAX_VALUE_CHARS = 4 << 20  # the worker's cap on all results of an execution (`_worker.RESULT_CAP`)


def parse_value(text: str) -> Any:
    """The value a program returned, from its repr, as plain data (never executes anything). Bounded:
    longer text, nesting past the parser's limits and malformed text are all a ValueError."""
    if len(text) > MAX_VALUE_CHARS:
        raise ValueError(f"a returned value of {len(text)} characters (limit {MAX_VALUE_CHARS})")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        specials = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
        if text in specials:
            return specials[text]
        raise ValueError(text) from None


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def compare_values(actual: Any, expected: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Python `==` on plain data, except that tuples equal lists and floats compare with a tolerance."""
    a, e = _plain(actual), _plain(expected)
    if isinstance(a, float) or isinstance(e, float):
        if isinstance(a, (int, float)) and isinstance(e, (int, float)):
            return math.isclose(a, e, rel_tol=rel_tol, abs_tol=abs_tol) or (math.isnan(a) and math.isnan(e))
        return False
    if isinstance(a, list) and isinstance(e, list):
        return len(a) == len(e) and all(compare_values(x, y, rel_tol, abs_tol) for x, y in zip(a, e))
    if isinstance(a, dict) and isinstance(e, dict):
        return a.keys() == e.keys() and all(compare_values(a[k], e[k], rel_tol, abs_tol) for k in a)
    return a == e


def normalize_stdout(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _short(text: Any, n: int = 200) -> str:
    s = text if isinstance(text, str) else repr(text)
    return s if len(s) <= n else s[:n] + "..."


def _tail(text: str, n: int = 600) -> str:
    return text if len(text) <= n else "..." + text[-n:]
