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
scratch on a capped tmpfs; without root: as the host user, whose processes it can then signal). `tempering
sandbox doctor` prints which protections are active here.

Model text on the host - every place where text the policy wrote reaches Python in the trainer process,
and why it stays inert there (tests in tests/envs, tests/sandbox/test_parse_value.py, tests/test_rewards.py):
- programs: run only here, in a worker. The trainer parses them with `ast.parse` (format reward, the
  hard-coding guard: `rewards/guards.parse_quietly`, at most 1 MiB, every error caught) and ruff reads
  them as files (code-style reward; a separate process that only parses);
- values a program returned: `parse_value`, `ast.literal_eval` of at most 4 MiB (what a worker can send),
  so plain literals only; nesting beyond the parser's limits is a ValueError, never code;
- answers (`envs/answer.py`): numbers via `float`, text compared as text; Countdown expressions are
  parsed (at most 200 characters) and walked over integer literals and + - * only, never evaluated;
- tool calls (`envs/tool_calls.py`, `services.py`, `calculator.py`): `json.loads` (too deep = a malformed
  call), `jsonschema` validation, the calculator walks the AST of at most 200 characters with capped
  exponents and magnitudes;
- reasoning-gym answers (`envs/gym.py`): several of its verifiers `eval` the answer (string_insertion,
  spiral_matrix, binary_matrix, n_queens) or evaluate it with sympy's `parse_expr` (countdown, puzzle24,
  integration, polynomial tasks), so every verifier runs in a sandbox pool of its own (`python_path` and
  `preload` below), one execution per answer, and a result counts only from a clean execution. Only
  game_of_life_halting's exact match, written by tempering, runs in the trainer;
- user hooks named in the config (`reward.step_fn`, `pkg.mod:fn` rewards, estimators, losses) are the
  user's own code and get the model's text in-process: they are trusted like the config itself.
Not model text, but read with the trust of code: configs (`yaml.safe_load`) and checkpoints (optimizer,
scheduler and RNG state are pickles, `torch.load(weights_only=False)`: load only checkpoints you wrote).

A pool may make a package importable to its workers: `LocalSandbox(python_path=(...), preload=(...))`
binds the directories read-only at the same path (bubblewrap) and puts them first on sys.path; each fork
server imports the `preload` modules once before it forks, so executions find them loaded.
"""

from __future__ import annotations

import threading

from tempering.config_sections import SandboxSection
from tempering.sandbox.execution import LANGUAGES, ExecRequest, SandboxLimits
from tempering.sandbox.grading import compare_values, grade, parse_value
from tempering.sandbox.pool import LocalSandbox, Sandbox
from tempering.sandbox.service import RemoteSandbox
from tempering.types import ExecResult, Task


def limits_of(s: SandboxSection) -> SandboxLimits:
    """A `sandbox` config section's per-execution limits."""
    return SandboxLimits(
        timeout_s=s.timeout_s, cpu_s=s.cpu_s, memory_mb=s.memory_mb, max_output_bytes=s.max_output_bytes
    )


def open_sandbox(
    s: SandboxSection | None = None, *, python_path: tuple[str, ...] = (), preload: tuple[str, ...] = ()
) -> Sandbox:
    """The one way to open a sandbox: the local worker pool of `s` (a run's `sandbox` section; None: its
    defaults, as `eval`, `repair` and `data from-logs` use), or the service at `s.url` (checked now: a service
    that is down is reported before a model loads). `python_path` and `preload` (`LocalSandbox`) make a
    package importable to a local pool's workers (the reasoning-gym verifiers' pool, `envs/gym.py`)."""
    s = s or SandboxSection()
    if s.url:
        if python_path or preload:
            raise ValueError("python_path and preload are a local pool's: a sandbox service imports its own")
        remote = RemoteSandbox(s.url, limits_of(s))
        remote.health()
        return remote
    return LocalSandbox(
        limits_of(s),
        workers=s.workers,
        python=s.python,
        isolation=s.isolation,
        scratch_mb=s.scratch_mb,
        python_path=python_path,
        preload=preload,
    )


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
    return default_sandbox().run(
        code, language=language, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb
    )


def run_batch(requests: list[ExecRequest], *, concurrency: int | None = None) -> list[ExecResult]:
    """Execute many programs in parallel; results in the order of `requests`."""
    return default_sandbox().run_batch(requests, concurrency=concurrency)


def run_tests(task: Task, code: str) -> ExecResult:
    """Execute `code` against the task's hidden tests."""
    return default_sandbox().run_tests(task, code)


__all__ = [
    "LANGUAGES",
    "ExecRequest",
    "ExecResult",
    "LocalSandbox",
    "RemoteSandbox",
    "Sandbox",
    "SandboxLimits",
    "compare_values",
    "default_sandbox",
    "grade",
    "limits_of",
    "open_sandbox",
    "parse_value",
    "run",
    "run_batch",
    "run_tests",
]
