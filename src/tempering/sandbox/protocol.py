"""What travels between `RemoteSandbox` and the service (`service.py`, `app.py`): an ExecRequest as JSON,
the body of POST /execute, and the caps the service enforces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pydantic import BaseModel

from tempering.sandbox.execution import ExecRequest, SandboxLimits, limits_problem

LIMIT_FIELDS = {f.name for f in fields(SandboxLimits)}


@dataclass(frozen=True)
class ServiceLimits:
    max_request_bytes: int = 16 << 20
    """Largest request body; a larger one gets 413 before it is read."""
    max_pending: int = 1024
    """Executions held at once by the whole service (running or waiting for a worker)."""
    client_pending: int = 256
    """Executions one client (by address) may hold at once."""
    client_concurrency: int | None = None
    """Executions of one client running at once; None: as many as there are workers."""
    max_timeout_s: float = 60.0
    """Cap on every request's wall-clock, CPU and compile time limits."""
    max_memory_mb: int = 2048
    """Cap on every request's memory limit."""
    max_output_bytes: int = 1 << 20
    """Cap on every request's output limit (per stream)."""
    max_file_bytes: int = 64 << 20
    """Cap on the largest file a request's program may write."""
    max_processes: int = 64
    """Cap on a request's processes and threads."""

    def clamp(self, limits: SandboxLimits) -> SandboxLimits:
        """A client's limits held within the service's: a client cannot ask for an hour or 64 GB."""
        t = self.max_timeout_s
        return replace(
            limits,
            timeout_s=min(limits.timeout_s, t),
            cpu_s=min(limits.cpu_s, t),
            compile_timeout_s=min(limits.compile_timeout_s, t),
            memory_mb=min(limits.memory_mb, self.max_memory_mb),
            max_output_bytes=min(limits.max_output_bytes, self.max_output_bytes),
            max_file_bytes=min(limits.max_file_bytes, self.max_file_bytes),
            max_processes=min(limits.max_processes, self.max_processes),
        )


class Batch(BaseModel):
    """The body of POST /execute."""

    requests: list[dict[str, Any]]


def request_to_json(req: ExecRequest) -> dict[str, Any]:
    return asdict(req)


def request_from_json(data: dict[str, Any]) -> ExecRequest:
    """The request a client sent; a ValueError (the service's 422) names an unknown or impossible limit
    before the request goes anywhere near a worker."""
    data = dict(data)
    limits = data.pop("limits", None) or {}
    unknown = set(limits) - LIMIT_FIELDS
    if unknown:
        raise ValueError(f"unknown limit(s) {sorted(unknown)}; valid: {sorted(LIMIT_FIELDS)}")
    req = ExecRequest(limits=SandboxLimits(**limits), **data)
    if why := limits_problem(req.limits):
        raise ValueError(why)
    return req
