"""Sandboxed execution of model-written programs.

    from tempering import sandbox
    sandbox.run("print(1 + 1)")                     # -> ExecResult(status='ok', stdout='2\n', ...)
    sandbox.run_tests(task, program)                 # -> ExecResult with one TestResult per hidden test

What is covered (this first version): every execution is a fresh process forked from a warm worker, in
its own session and process group, in a fresh scratch directory that is deleted afterwards, with limits on
wall time (the whole process group is killed), CPU time, address space, file size and open files; output
is captured up to a cap; the program sees none of the host's environment variables; expected test
outputs never enter the sandbox (the host compares returned values), so exiting early, printing fake
verdicts or returning objects with a rigged `__eq__` cannot pass a test.

What is not covered yet: the program runs as the caller's user, on the host's filesystem and network;
a program that detaches into a new session can outlive its run; `RLIMIT_NPROC` does not bind root.
Do not run untrusted code with this version on a machine you care about.
"""

from __future__ import annotations

import threading

from tempering.sandbox.local import (
    ExecRequest,
    LocalSandbox,
    SandboxLimits,
    compare_values,
    grade,
    parse_value,
)
from tempering.types import ExecResult, Task

_default: LocalSandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> LocalSandbox:
    """A process-wide sandbox with default limits, started on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = LocalSandbox()
        return _default


def run(
    code: str,
    *,
    language: str = "python",
    stdin: str | None = None,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
) -> ExecResult:
    """Execute one program and return what it did."""
    return default_sandbox().run(code, language=language, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)


def run_batch(requests: list[ExecRequest], *, concurrency: int | None = None) -> list[ExecResult]:
    """Execute many programs in parallel; results in the order of `requests`."""
    return default_sandbox().run_batch(requests, concurrency=concurrency)


def run_tests(task: Task, code: str) -> ExecResult:
    """Execute `code` against the task's hidden tests."""
    return default_sandbox().run_tests(task, code)


__all__ = [
    "ExecRequest", "ExecResult", "LocalSandbox", "SandboxLimits", "compare_values", "default_sandbox", "grade",
    "parse_value", "run", "run_batch", "run_tests",
]
