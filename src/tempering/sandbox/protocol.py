"""What travels between `RemoteSandbox` and the service (`service.py`, `app.py`): an ExecRequest as JSON,
the body of POST /execute, and the caps the service enforces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from pydantic import BaseModel

from tempering.sandbox.execution import ExecRequest, SandboxLimits

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
    """Cap on a /run_code request's run and compile timeouts."""


class Batch(BaseModel):
    """The body of POST /execute."""

    requests: list[dict[str, Any]]


def request_to_json(req: ExecRequest) -> dict[str, Any]:
    return asdict(req)


def request_from_json(data: dict[str, Any]) -> ExecRequest:
    data = dict(data)
    limits = data.pop("limits", None) or {}
    unknown = set(limits) - LIMIT_FIELDS
    if unknown:
        raise ValueError(f"unknown limit(s) {sorted(unknown)}; valid: {sorted(LIMIT_FIELDS)}")
    return ExecRequest(limits=SandboxLimits(**limits), **data)
