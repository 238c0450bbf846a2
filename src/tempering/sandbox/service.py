"""The sandbox as an HTTP service (`tempering sandbox serve`) and its client, `RemoteSandbox`.

    POST /execute  {"requests": [ExecRequest, ...]}  ->  {"results": [raw result, ...]}
    GET  /health   ->  {"status": "ok", "backend": ..., "workers": n, "protections": [...]}

The client grades tests itself (`Sandbox.run_tests_batch`), so expected outputs never travel to the
service; `check()` test code does (it must run next to the program). The service holds at most
`max_pending` executions at once and answers 429 beyond that; the client backs off and retries, which
is the backpressure. It listens on loopback unless told otherwise: it executes whatever it is sent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, fields
from typing import Any

from pydantic import BaseModel

from tempering.errors import SandboxError
from tempering.sandbox.local import ExecRequest, LocalSandbox, Sandbox, SandboxLimits

LIMIT_FIELDS = {f.name for f in fields(SandboxLimits)}


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


def create_app(sandbox: LocalSandbox, *, max_pending: int = 1024):
    """A FastAPI app executing requests on `sandbox`."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="tempering sandbox")
    pending = threading.BoundedSemaphore(max_pending)
    lock = threading.Lock()
    state = {"pending": 0}

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "backend": sandbox.backend, "workers": sandbox.size, "pending": state["pending"],
                "protections": [asdict(p) for p in sandbox.protections()]}

    @app.post("/execute")
    def execute(batch: Batch) -> dict[str, Any]:  # a plain def: FastAPI runs it on its thread pool
        try:
            reqs = [request_from_json(r) for r in batch.requests]
        except (TypeError, ValueError) as e:
            raise HTTPException(status_code=422, detail=f"bad request: {e}") from None
        if len(reqs) > max_pending:
            raise HTTPException(status_code=413, detail=f"a batch of {len(reqs)} executions is more than this "
                                f"service holds at once ({max_pending}); send smaller batches")
        taken = 0
        try:
            for _ in reqs:
                if not pending.acquire(blocking=False):
                    raise HTTPException(status_code=429, detail="sandbox busy", headers={"Retry-After": "1"})
                taken += 1
            with lock:
                state["pending"] += taken
            try:
                return {"results": sandbox.execute_many(reqs)}
            except SandboxError as e:
                raise HTTPException(status_code=422, detail=str(e)) from None
            finally:
                with lock:
                    state["pending"] -= taken
        finally:
            for _ in range(taken):
                pending.release()

    return app


def serve(host: str = "127.0.0.1", port: int = 8080, *, workers: int = 2, isolation: str = "auto",
          limits: SandboxLimits | None = None, max_pending: int = 1024) -> None:
    """Run the service until interrupted."""
    import uvicorn

    with LocalSandbox(limits, workers=workers, isolation=isolation) as sandbox:
        app = create_app(sandbox, max_pending=max_pending)
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)


class RemoteSandbox(Sandbox):
    """A sandbox service reached over HTTP; the same API as LocalSandbox.

    Connection failures and 429/5xx answers are retried with exponential backoff; when the service
    stays unreachable the error says which URL and why.
    """

    def __init__(self, url: str, limits: SandboxLimits | None = None, *, timeout_s: float = 120.0,
                 retries: int = 4, backoff_s: float = 0.5, batch_size: int = 256, concurrency: int = 4):
        import httpx

        self.url = url.rstrip("/")
        self.limits = limits or SandboxLimits()
        self.retries, self.backoff_s, self.batch_size, self.concurrency = retries, backoff_s, batch_size, concurrency
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.size = concurrency

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def execute_many(self, requests: list[ExecRequest], *, concurrency: int | None = None) -> list[dict[str, Any]]:
        from concurrent.futures import ThreadPoolExecutor

        chunks = [requests[i: i + self.batch_size] for i in range(0, len(requests), self.batch_size)]

        def send(chunk: list[ExecRequest]) -> list[dict[str, Any]]:
            body = {"requests": [request_to_json(r) for r in chunk]}
            return self._call("POST", "/execute", json=body)["results"]

        if len(chunks) <= 1:
            return send(chunks[0]) if chunks else []
        with ThreadPoolExecutor(max_workers=min(concurrency or self.concurrency, len(chunks))) as pool:
            return [r for part in pool.map(send, chunks) for r in part]

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            try:
                resp = self._client.request(method, path, **kw)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code == 200:
                    return resp.json()
                if resp.status_code not in (429, 502, 503, 504):
                    raise SandboxError(f"sandbox service at {self.url} refused the request "
                                       f"({resp.status_code}): {resp.text[:500]}")
                last = f"HTTP {resp.status_code}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2 ** attempt)
        if last == "HTTP 429":
            raise SandboxError(f"sandbox service at {self.url} is still busy (HTTP 429) after {self.retries + 1} "
                               "attempts; send smaller batches or raise its --max-pending")
        raise SandboxError(f"sandbox service at {self.url} is not reachable after {self.retries + 1} attempts "
                           f"({last}); is `tempering sandbox serve` running there?")

    def close(self) -> None:
        self._client.close()
