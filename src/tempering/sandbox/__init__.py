"""Sandboxed execution of model-written programs.

    from tempering import sandbox
    sandbox.run("print(1 + 1)")                     # -> ExecResult(status='ok', stdout='2\n', ...)
    sandbox.run("int main(){}", language="c")       # python, c, cpp, javascript, bash
    sandbox.run_tests(task, program)                 # -> ExecResult with one TestResult per hidden test

Threat model - what is covered. A pool of warm workers, each a fork server; with bubblewrap (the
default where it works, `isolation.py`) each worker is PID 1 of its own PID, network, IPC, UTS and cgroup
namespaces, sees only /usr read-only and a scratch tmpfs capped in bytes (64 MiB) and in inodes (8192),
has an empty environment and dies with its parent. Programs run under a uid other than their server's:
on a root host each worker has two host uids, mapped into a user namespace of its own, and the server
keeps only what it needs there (switching a child's uid, killing leftovers, wiping scratch); each
execution is a forked child that switches to the program uid (which drops every capability; no
new privileges by exec), so it cannot signal, ptrace or `prlimit` its server or the checker, nor make a
user namespace (and an uncapped tmpfs) of its own. Every execution also gets rlimits on CPU time,
address space, processes/threads (per program uid), file size and open files, its own session, a
wall-clock timeout, stdout/stderr capped (then truncated and flagged); after it every leftover process
is killed (a daemon cannot outlive it) and the scratch area is wiped. The server checks its own rlimits
after each execution: a worker found damaged, hung, dead or answering `sandbox_error` is replaced before
it serves again, and damage by a program is that program's `killed`, never `sandbox_error`. Every worker
has PYTHONHASHSEED=0, so output that depends on set order is the same on every worker. Tests cannot be
fooled from inside: expected values never enter the sandbox (the caller compares plain literals),
check() test code runs in a separate process that has no capabilities, is not dumpable and runs under
the server's uid, and what the program tried (exiting before the tests, patching builtins, forged
results, network, processes, signals, files outside its directory) is reported in `ExecResult.flags`.
`tempering sandbox serve` listens on loopback; on any other address it requires a shared token, and it
caps request size and each client's queued and running executions (service.py).

What is not covered. The kernel is shared: a kernel exploit escapes any namespace sandbox (use a VM or
gVisor for hostile code at scale). There is no seccomp filter, so every system call reaches the kernel.
CPU is limited per execution, not shared fairly between workers (no cgroups: cgroup v2 controllers are
not delegated here). Without root, a second uid cannot be mapped: programs share their server's uid
(a bubblewrap worker is still PID 1, which ignores their signals, and rlimit damage is detected and the
worker replaced), the scratch has no inode cap and nested user namespaces are allowed. Without
bubblewrap (`isolation=process`, or where it cannot start) network, filesystem and PID isolation are
off: the program runs on the host's filesystem and network (as root: under its own uid, with the
scratch on a capped tmpfs; without root: as the host user, whose processes it can then signal). The
host side of the sandbox parses what a program returns only with `ast.literal_eval` (bounded by the
output caps), never `eval`. `tempering sandbox doctor` prints which protections are active here.
"""

from __future__ import annotations

import threading

from tempering.sandbox.local import (
    LANGUAGES,
    ExecRequest,
    LocalSandbox,
    Sandbox,
    SandboxLimits,
    compare_values,
    grade,
    parse_value,
)
from tempering.sandbox.service import RemoteSandbox
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
    "LANGUAGES", "ExecRequest", "ExecResult", "LocalSandbox", "RemoteSandbox", "Sandbox", "SandboxLimits",
    "compare_values", "default_sandbox", "grade", "parse_value", "run", "run_batch", "run_tests",
]
