"""The HTTP app of `tempering sandbox serve`: the endpoints behind the shared guard and admission
(`tempering.http`: token, body size, per-client caps), each client's executions run a few at a time.

See `service.py` for what each endpoint does and which limits apply. (No `from __future__ import
annotations` here: FastAPI reads the endpoints' annotations at run time.)
"""

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from tempering.errors import SandboxError
from tempering.http import Admission, Guard
from tempering.sandbox import fusion
from tempering.sandbox.execution import ExecRequest
from tempering.sandbox.pool import LocalSandbox
from tempering.sandbox.protocol import Batch, ServiceLimits, request_from_json

# -------------------------------------------------------------------------------------- admission


class ClientSlots:
    """A client's running executions capped by a semaphore (the rest of its admitted ones wait)."""

    def __init__(self, concurrency: int):
        self.concurrency = concurrency
        self.lock = threading.Lock()
        self.slots: dict[str, threading.BoundedSemaphore] = {}

    def run(self, sandbox: LocalSandbox, client: str, reqs: list[ExecRequest]) -> list[dict[str, Any]]:
        """Execute on the pool, at most `concurrency` of this client's executions at a time."""
        with self.lock:
            slot = self.slots.setdefault(client, threading.BoundedSemaphore(self.concurrency))

        def one(req: ExecRequest) -> dict[str, Any]:
            with slot:
                return sandbox.execute(req)

        if len(reqs) <= 1:
            return [one(r) for r in reqs]
        with ThreadPoolExecutor(max_workers=min(len(reqs), self.concurrency)) as pool:
            return list(pool.map(one, reqs))


# --------------------------------------------------------------------------------------------- app


def create_app(sandbox: LocalSandbox, *, token: str | None, limits: ServiceLimits):
    """FastAPI executing requests on `sandbox`, behind `Guard`."""
    admission = Admission(limits.max_pending, limits.client_pending)
    slots = ClientSlots(max(1, limits.client_concurrency or sandbox.size))
    app = FastAPI(title="tempering sandbox", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    def health() -> dict[str, Any]:
        """The backend, the worker count, the executions pending and the protections in force."""
        return {
            "status": "ok",
            "backend": sandbox.backend,
            "workers": sandbox.size,
            "pending": admission.total,
            "protections": [asdict(p) for p in sandbox.protections()],
        }

    @app.post("/execute")
    def execute(
        batch: Batch, request: Request
    ) -> dict[str, Any]:  # a plain def: run on FastAPI's thread pool
        """Execute a batch of requests (`ExecRequest` as JSON); the raw results, in order."""
        try:
            reqs = [request_from_json(r) for r in batch.requests]
            reqs = [replace(r, limits=limits.clamp(r.limits)) for r in reqs]
        except (TypeError, ValueError) as e:
            raise HTTPException(status_code=422, detail=f"bad request: {e}") from None
        client = request.client.host if request.client else "?"
        admission.enter(client, len(reqs))
        try:
            return {"results": slots.run(sandbox, client, reqs)}
        except SandboxError as e:
            raise HTTPException(status_code=422, detail=str(e)) from None
        finally:
            admission.leave(client, len(reqs))

    @app.post("/run_code")
    def run_code(body: fusion.RunCode, request: Request) -> dict[str, Any]:
        """SandboxFusion's `/run_code`, request and response, for its existing clients (verl's reward)."""
        why = fusion.unsupported(body)
        if why:
            return fusion.error_response(why)
        client = request.client.host if request.client else "?"
        admission.enter(client, 1)
        try:
            req = fusion.to_request(body, sandbox.limits, limits.max_timeout_s)
            [raw] = slots.run(sandbox, client, [replace(req, limits=limits.clamp(req.limits))])
        except SandboxError as e:
            return fusion.error_response(str(e))
        finally:
            admission.leave(client, 1)
        return fusion.to_response(raw, body.language)

    return Guard(app, token, limits.max_request_bytes)
