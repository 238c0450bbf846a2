"""SandboxFusion's `POST /run_code`, spoken by `tempering sandbox serve`.

SandboxFusion (github.com/bytedance/SandboxFusion) is the code sandbox that verl's `sandbox_fusion`
reward and other RL tools call. Its request:

    {"code": str, "language": "python" | "cpp" | "nodejs" | "bash" | ..., "compile_timeout": s, "run_timeout": s,
     "memory_limit_MB": int (-1: the default), "stdin": str | null, "files": {}, "fetch_files": []}

and its response:

    {"status": "Success" | "Failed" | "SandboxError", "message": str,
     "compile_result": CommandRunResult | null, "run_result": CommandRunResult | null,
     "executor_pod_name": null, "files": {}}
    CommandRunResult = {"status": "Finished" | "Error" | "TimeLimitExceeded", "execution_time": s,
                        "return_code": int | null, "stdout": str, "stderr": str}

`Failed` is the program's own failure (a non-zero exit, a time limit; a compile error has only a
`compile_result`); `SandboxError` is the sandbox's. A client of SandboxFusion can point at tempering's
service unchanged (see docs/internals/architecture.md, "Sandbox"); the code here is written from that shape.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from tempering.sandbox.execution import ExecRequest, SandboxLimits

# SandboxFusion's language names -> tempering's. "c" and "javascript" are tempering's own names, accepted too.
LANGUAGES = {
    "python": "python",
    "cpp": "cpp",
    "c": "c",
    "nodejs": "javascript",
    "javascript": "javascript",
    "bash": "bash",
}
COMPILED = ("c", "cpp")


class RunCode(BaseModel):
    """The body of POST /run_code (fields and defaults as SandboxFusion's)."""

    code: str
    language: str
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory_limit_MB: int = -1  # noqa: N815 (SandboxFusion's field name)
    stdin: str | None = None
    files: dict[str, str | None] = {}
    fetch_files: list[str] = []


def unsupported(body: RunCode) -> str | None:
    """Why this request cannot run here, or None."""
    if body.language not in LANGUAGES:
        return (
            f"language '{body.language}' is not supported by tempering's sandbox; "
            f"supported: {', '.join(LANGUAGES)}"
        )
    if body.files or body.fetch_files:
        return "files and fetch_files are not supported by tempering's sandbox"
    return None


def to_request(body: RunCode, limits: SandboxLimits, max_timeout_s: float) -> ExecRequest:
    """The ExecRequest for a /run_code body; timeouts are capped at `max_timeout_s`."""
    run_s = max(0.1, min(body.run_timeout, max_timeout_s))
    memory = body.memory_limit_MB if body.memory_limit_MB > 0 else limits.memory_mb
    lim = replace(
        limits,
        timeout_s=run_s,
        cpu_s=run_s,
        memory_mb=memory,
        compile_timeout_s=max(0.1, min(body.compile_timeout, max_timeout_s)),
    )
    return ExecRequest(code=body.code, language=LANGUAGES[body.language], stdin=body.stdin, limits=lim)


def _command(status: str, time_s: Any, return_code: int | None, stdout: str = "", stderr: str = "") -> dict:
    return {
        "status": status,
        "execution_time": time_s,
        "return_code": return_code,
        "stdout": stdout,
        "stderr": stderr,
    }


def error_response(message: str) -> dict[str, Any]:
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }


def to_response(raw: dict[str, Any], language: str) -> dict[str, Any]:
    """A worker's raw result (see `_worker.collect`) in SandboxFusion's response shape."""
    status = raw.get("status")
    if status == "sandbox_error":
        return error_response(raw.get("stderr") or "sandbox error")
    out = {
        "status": "Failed",
        "message": "" if status == "ok" else status,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }
    if LANGUAGES.get(language) in COMPILED:
        if status == "compile_error":
            timed_out = bool(raw.get("compile_timed_out"))
            out["compile_result"] = _command(
                "TimeLimitExceeded" if timed_out else "Finished",
                raw.get("wall_time_s"),
                None if timed_out else raw.get("exit_code", 1),
                "",
                raw.get("stderr", ""),
            )
            return out
        out["compile_result"] = _command("Finished", raw.get("compile_time_s"), 0)
    if status == "timeout":
        code = None
    elif raw.get("exit_code") is not None:
        code = raw["exit_code"]
    else:  # killed by a signal: the negative signal number, as a subprocess reports it
        code = -(raw.get("signal") or 9)
    out["run_result"] = _command(
        "TimeLimitExceeded" if status == "timeout" else "Finished",
        raw.get("wall_time_s"),
        code,
        raw.get("stdout", ""),
        raw.get("stderr", ""),
    )
    if status == "ok" and code == 0:
        out["status"] = "Success"
    return out
