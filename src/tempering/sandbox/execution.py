"""What one execution is: the request and its limits, and the worker's raw answer read as an ExecResult."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from tempering.types import ExecResult

LANGUAGES = ("python", "bash", "javascript", "c", "cpp")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 2.0
    """Wall-clock limit; the whole process tree is killed when it passes."""
    cpu_s: float = 2.0
    """CPU-time limit (RLIMIT_CPU)."""
    memory_mb: int = 256
    """Address space on top of the interpreter's own (RLIMIT_AS); for JavaScript, V8's heap limit."""
    max_output_bytes: int = 65536
    """Per stream; a program that writes more is stopped with status output_limit."""
    max_file_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    max_processes: int = 32
    """RLIMIT_NPROC: processes and threads of the program's uid (each worker has its own when the host
    is root; a non-root host shares its uid's count with the sandbox)."""
    compile_timeout_s: float = 20.0
    """Wall-clock limit of compiling a C/C++ program (its own limit, before `timeout_s` starts)."""


WHOLE_LIMITS = ("memory_mb", "max_output_bytes", "max_file_bytes", "max_processes")


def limits_problem(limits: SandboxLimits) -> str | None:
    """Why `limits` cannot be run, or None: every limit is a finite number above 0 (a whole one for sizes
    and counts). A NaN deadline breaks the host's wait, 0 or a negative one kills every program at once,
    and -1 is RLIMIT_INFINITY to setrlimit: no limit at all."""
    for f in fields(limits):
        value, whole = getattr(limits, f.name), f.name in WHOLE_LIMITS
        number = not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
        if not (number and (whole or math.isfinite(value)) and value > 0):
            return f"limits.{f.name} must be a {'whole' if whole else 'finite'} number above 0, not {value!r}"
    return None


@dataclass
class ExecRequest:
    """One execution: a whole program (`stdin`), function calls on `entry_point` (`calls`), or
    HumanEval-style `check(candidate)` test code run against `entry_point` from a separate process."""

    code: str
    language: str = "python"
    stdin: str | None = None
    entry_point: str | None = None
    calls: list[list[Any]] | None = None
    checks: list[str] | None = None
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    @property
    def kind(self) -> str:
        return "check" if self.checks is not None else "calls" if self.calls is not None else "program"


def to_result(raw: dict[str, Any]) -> ExecResult:
    """A raw worker response (see `_worker.collect`) as an ExecResult, without per-test verdicts."""
    fields = {k: raw[k] for k in ExecResult.__dataclass_fields__ if k in raw and k != "tests"}
    return ExecResult(**fields)
