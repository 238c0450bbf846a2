"""The HTTP app of `tempering sandbox serve`: auth and size guard, per-client admission, the endpoints.

See `service.py` for what each endpoint does and which limits apply. (No `from __future__ import
annotations` here: FastAPI reads the endpoints' annotations at run time.)
"""

import hmac
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, HTTPException, Request

from tempering.errors import SandboxError
from tempering.sandbox import fusion
from tempering.sandbox.execution import ExecRequest
from tempering.sandbox.pool import LocalSandbox
from tempering.sandbox.protocol import Batch, ServiceLimits, request_from_json

# --------------------------------------------------------------------------------------- admission


class Admission:
    """Work held per client and in all (waiting or running): past either cap, 429 with Retry-After; a
    single request larger than a client may ever hold, 413. Shared by the sandbox service (executions) and
    `tempering serve` (generations)."""

    def __init__(self, max_pending: int, client_pending: int, noun: str = "executions", who: str = "sandbox"):
        self.max_pending, self.client_pending, self.noun, self.who = max_pending, client_pending, noun, who
        self.lock = threading.Lock()
        self.held: dict[str, int] = {}
        self.total = 0

    def enter(self, client: str, n: int) -> None:
        cap = min(self.client_pending, self.max_pending)
        if n > cap:
            raise HTTPException(status_code=413, detail=f"a request of {n} {self.noun} is more than one client may "
                                f"hold at once ({cap}); send smaller requests")
        with self.lock:
            if why := self.busy(client, n):
                raise HTTPException(status_code=429, headers={"Retry-After": "1"}, detail=why)
            self.held[client] = self.held.get(client, 0) + n
            self.total += n

    def busy(self, client: str, n: int = 1) -> str | None:
        """Why `n` more of `client`'s would not fit (the 429's message), or None. Without the lock it is a
        cheap early look (`tempering serve` answers a flood before parsing it); `enter` decides."""
        if self.held.get(client, 0) + n > self.client_pending:
            return f"{self.who} busy: this client already holds the {self.noun} it may"
        if self.total + n > self.max_pending:
            return f"{self.who} busy: the {self.who} already holds the {self.noun} it may"
        return None

    def leave(self, client: str, n: int) -> None:
        with self.lock:
            self.total -= n
            self.held[client] -= n
            if not self.held[client]:
                del self.held[client]


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


class Guard:
    """ASGI middleware: the token (401), then the body size (413), before the app sees the request."""

    def __init__(self, app, token: str | None, max_bytes: int,
                 error: Callable[[int, str], dict] = lambda status, detail: {"detail": detail}):
        self.app, self.token, self.max_bytes = app, token, max_bytes
        self.error = error
        """The body of a refusal, from its status and message (`tempering serve`: OpenAI's shape)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.token is not None and not self._authorized(scope, headers):
            why = "missing or wrong token: send 'Authorization: Bearer <token>'"
            return await _reply(send, 401, self.error(401, why), [(b"www-authenticate", b"Bearer")])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await _reply(send, 413, self.error(413, f"request body over {self.max_bytes} bytes"))
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, receive, send)  # the client went away
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await _reply(send, 413, self.error(413, f"request body over {self.max_bytes} bytes"))
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    def _authorized(self, scope, headers) -> bool:
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given.startswith("Bearer "):
            given = given[len("Bearer "):]
        else:
            given = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), self.token.encode())


async def _reply(send, status: int, content: dict, headers: list | None = None) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------------------------- app


def create_app(sandbox: LocalSandbox, *, token: str | None, limits: ServiceLimits):
    """FastAPI executing requests on `sandbox`, behind `Guard`."""
    admission = Admission(limits.max_pending, limits.client_pending)
    slots = ClientSlots(max(1, limits.client_concurrency or sandbox.size))
    app = FastAPI(title="tempering sandbox", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "backend": sandbox.backend, "workers": sandbox.size, "pending": admission.total,
                "protections": [asdict(p) for p in sandbox.protections()]}

    @app.post("/execute")
    def execute(batch: Batch, request: Request) -> dict[str, Any]:  # a plain def: run on FastAPI's thread pool
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
