"""The HTTP pieces that the sandbox service, `tempering serve` and the HTTP engine share.

    read_token       a shared secret from a file or an environment variable (at least MIN_TOKEN_CHARS)
    is_loopback      whether an address is this machine's only (no token needed there)
    Admission        work held per client and in all: 429 with Retry-After past a cap, 413 past what fits
    Guard            ASGI middleware: the bearer token (401), then the request body's size (413)
    RetryingClient   an httpx client that retries a failed connection and 429 / 502-504 with backoff

The servers (`sandbox/app.py`, `agent/server.py`) put `Guard` in front and admit work through `Admission`;
the clients (`sandbox.service.RemoteSandbox`, `inference.remote.HTTPEngine`) send through `RetryingClient`
and word the errors for what they reach.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from tempering.errors import TemperingError

MIN_TOKEN_CHARS = 16

# ------------------------------------------------------------------------------ tokens, addresses


def read_token(token_file: str | None, env: str, file_env: str) -> str | None:
    """A shared secret: the first line of `token_file` (or of the file named by $`file_env`), else $`env`,
    else None. (The sandbox service reads TEMPERING_SANDBOX_TOKEN[_FILE], `tempering serve`
    TEMPERING_SERVE_TOKEN[_FILE].)"""
    path = token_file or os.environ.get(file_env)
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise TemperingError(f"cannot read the token file '{path}': {e.strerror}") from None
        token = lines[0].strip() if lines else ""
    else:
        token = os.environ.get(env, "").strip()
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise TemperingError(
            f"the token (${env} or its file) is {len(token)} characters; use at least "
            f"{MIN_TOKEN_CHARS} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return token


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -------------------------------------------------------------------------------------- servers


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
        from fastapi import HTTPException

        if n > cap:
            raise HTTPException(
                status_code=413,
                detail=f"a request of {n} {self.noun} is more than one client may "
                f"hold at once ({cap}); send smaller requests",
            )
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


class Guard:
    """ASGI middleware: the token (401), then the body size (413), before the app sees the request."""

    def __init__(
        self,
        app,
        token: str | None,
        max_bytes: int,
        error: Callable[[int, str], dict] = lambda status, detail: {"detail": detail},
        accepts: Callable[[str, str], bool] | None = None,
    ):
        self.app, self.token, self.max_bytes = app, token, max_bytes
        self.error = error
        """The body of a refusal, from its status and message (`tempering serve`: OpenAI's shape)."""
        self.accepts = accepts
        """(path, key) -> whether another key may pass to the app, which checks it (a session's key)."""

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
            given = given[len("Bearer ") :]
        else:
            given = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token") or [""])[0]
        if self.accepts is not None and self.accepts(scope["path"], given):
            return True
        return hmac.compare_digest(given.encode(), self.token.encode())


async def _reply(send, status: int, content: dict, headers: list | None = None) -> None:
    body = json.dumps(content).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


# -------------------------------------------------------------------------------------- clients


class Unreachable(TemperingError):
    """Every attempt failed before an answer came (`why`: the last failure)."""

    def __init__(self, why: str, attempts: int):
        super().__init__(f"not reachable after {attempts} attempts ({why})")
        self.why, self.attempts = why, attempts


class RetryingClient:
    """An httpx client that retries what may pass by itself - a connection that failed, an answer 429
    (busy) or 502-504 (a proxy or a restart) - with exponential backoff (`backoff_s * 2**attempt`); any
    other answer comes back at once. `token` is sent as `Authorization: Bearer`."""

    RETRIED = (429, 502, 503, 504)

    def __init__(
        self,
        base_url: str = "",
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        connect_s: float = 5.0,
        retries: int = 4,
        backoff_s: float = 0.5,
    ):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(
            base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=connect_s), headers=headers
        )
        self.retries, self.backoff_s = retries, backoff_s

    def request(self, method: str, path: str, *, retries: int | None = None, **kw: Any):
        """The answer (an `httpx.Response`; after the last retry, a retried status as it came), or
        `Unreachable` when no attempt got one. `retries`: this call's own (0: fail fast, a probe)."""
        import httpx

        retries = self.retries if retries is None else retries
        answer, why = None, ""
        for attempt in range(retries + 1):
            try:
                answer = self.client.request(method, path, **kw)
            except httpx.TransportError as e:
                answer, why = None, f"{type(e).__name__}: {e}"
            else:
                if answer.status_code not in self.RETRIED:
                    return answer
            if attempt < retries:
                time.sleep(self.backoff_s * 2**attempt)
        if answer is None:
            raise Unreachable(why, retries + 1)
        return answer

    def close(self) -> None:
        self.client.close()


def check_address(host: str, port: int) -> None:
    """A server could listen on host:port - a host of this machine, no server there already - checked
    before anything is loaded (a model: minutes). The port's range is the CLI's `port_number`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as e:
        raise TemperingError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
