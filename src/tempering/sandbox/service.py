"""The sandbox as an HTTP service (`tempering sandbox serve`) and its client, `RemoteSandbox`.

    POST /execute   {"requests": [ExecRequest, ...]}  ->  {"results": [raw result, ...]}
    POST /run_code  SandboxFusion's request and response (see `fusion.py`), for its existing clients
    GET  /health    ->  {"status": "ok", "backend": ..., "workers": n, "protections": [...]}

The client grades tests itself (`Sandbox.run_tests_batch`), so expected outputs never travel to the
service; `check()` test code does (it must run next to the program).

Exposure. The service executes whatever it is sent, so: it listens on loopback unless told otherwise,
and on any other address it refuses to start without a shared secret (`TEMPERING_SANDBOX_TOKEN`, or a
file named by `--token-file` / `TEMPERING_SANDBOX_TOKEN_FILE`). With a token every request must carry
`Authorization: Bearer <token>` (or `?token=<token>` in the URL, for clients that cannot set headers,
such as verl's `sandbox_fusion` reward), else 401. Every request is capped: a body larger than
`max_request_bytes` gets 413 before it is read; each client (by address) may hold `client_pending`
executions (running or queued) and run `client_concurrency` at once; the service as a whole holds
`max_pending`. Beyond these the answer is 429 with Retry-After (the client backs off and retries), or
413 for a batch that could never fit.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from tempering.errors import SandboxError, TemperingError
from tempering.http import MIN_TOKEN_CHARS, RetryingClient, Unreachable, is_loopback, read_token
from tempering.sandbox.execution import ExecRequest, SandboxLimits
from tempering.sandbox.isolation import Protection
from tempering.sandbox.pool import LocalSandbox, Sandbox
from tempering.sandbox.protocol import ServiceLimits, request_to_json

TOKEN_ENV, TOKEN_FILE_ENV = "TEMPERING_SANDBOX_TOKEN", "TEMPERING_SANDBOX_TOKEN_FILE"


def sandbox_token(token_file: str | None = None) -> str | None:
    """The service's shared secret as server and clients read it (`http.read_token` of $TEMPERING_SANDBOX_TOKEN
    or the file named by --token-file / $TEMPERING_SANDBOX_TOKEN_FILE); a bad one is a SandboxError."""
    try:
        return read_token(token_file, TOKEN_ENV, TOKEN_FILE_ENV)
    except TemperingError as e:
        raise SandboxError(str(e)) from None


def service_protection(token: str | None = None) -> Protection:
    """What `tempering sandbox serve` would require here (for `tempering sandbox doctor`)."""
    lim = ServiceLimits()
    state = "a token is configured here" if token else f"no token configured here (${TOKEN_ENV})"
    return Protection(
        "service auth and caps",
        True,
        f"`serve` on a non-loopback address requires a bearer token ({state}); bodies <= "
        f"{lim.max_request_bytes >> 20} MiB, per-client caps on queued and running executions",
    )


def create_app(
    sandbox: LocalSandbox,
    *,
    token: str | None = None,
    limits: ServiceLimits | None = None,
    max_pending: int | None = None,
):
    """An ASGI app executing requests on `sandbox` (see `app.py`)."""
    from tempering.sandbox.app import create_app as create

    limits = limits or ServiceLimits()
    if max_pending is not None:
        limits = ServiceLimits(**{**asdict(limits), "max_pending": max_pending})
    return create(sandbox, token=token, limits=limits)


def serve(
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    workers: int = 2,
    isolation: str = "auto",
    limits: SandboxLimits | None = None,
    service: ServiceLimits | None = None,
    token: str | None = None,
) -> None:
    """Run the service until interrupted. Refuses a non-loopback address without a token."""
    import uvicorn

    if token is None and not is_loopback(host):
        raise SandboxError(
            f"refusing to serve on {host} without a token: anyone reaching it could run code; set "
            f"${TOKEN_ENV} (or --token-file) to a secret of at least {MIN_TOKEN_CHARS} characters, "
            "and give it to the clients"
        )
    with LocalSandbox(limits, workers=workers, isolation=isolation) as sandbox:
        app = create_app(sandbox, token=token, limits=service)
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)


class RemoteSandbox(Sandbox):
    """A sandbox service reached over HTTP; the same API as LocalSandbox.

    Connection failures and 429/5xx answers are retried with exponential backoff (`http.RetryingClient`);
    when the service stays unreachable the error says which URL and why. The token is `token`, else read as the
    service reads it (`TEMPERING_SANDBOX_TOKEN` / `TEMPERING_SANDBOX_TOKEN_FILE`).
    """

    def __init__(
        self,
        url: str,
        limits: SandboxLimits | None = None,
        *,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        batch_size: int = 256,
        concurrency: int = 4,
        token: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.limits = limits or SandboxLimits()
        self.batch_size, self.concurrency = batch_size, concurrency
        self._http = RetryingClient(
            self.url,
            token=token or sandbox_token(),
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
        )
        self.size = concurrency

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def execute_many(
        self, requests: list[ExecRequest], *, concurrency: int | None = None
    ) -> list[dict[str, Any]]:
        chunks = [requests[i : i + self.batch_size] for i in range(0, len(requests), self.batch_size)]

        def send(chunk: list[ExecRequest]) -> list[dict[str, Any]]:
            body = {"requests": [request_to_json(r) for r in chunk]}
            return self._call("POST", "/execute", json=body)["results"]

        if len(chunks) <= 1:
            return send(chunks[0]) if chunks else []
        with ThreadPoolExecutor(max_workers=min(concurrency or self.concurrency, len(chunks))) as pool:
            return [r for part in pool.map(send, chunks) for r in part]

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            resp = self._http.request(method, path, **kw)
        except Unreachable as e:
            raise SandboxError(
                f"sandbox service at {self.url} is {e}; is `tempering sandbox serve` running there?"
            ) from None
        if resp.status_code == 200:
            return resp.json()
        if resp.status_code == 401:
            raise SandboxError(
                f"sandbox service at {self.url} refused the token (401); set ${TOKEN_ENV} "
                "(or $TEMPERING_SANDBOX_TOKEN_FILE) to the service's token"
            )
        attempts = self._http.retries + 1
        if resp.status_code == 429:
            raise SandboxError(
                f"sandbox service at {self.url} is still busy (HTTP 429) after {attempts} "
                "attempts; send smaller batches or raise its --max-pending / --client-pending"
            )
        if resp.status_code in RetryingClient.RETRIED:
            raise SandboxError(
                f"sandbox service at {self.url} is not reachable after {attempts} attempts "
                f"(HTTP {resp.status_code}); is `tempering sandbox serve` running there?"
            )
        raise SandboxError(
            f"sandbox service at {self.url} refused the request ({resp.status_code}): {resp.text[:500]}"
        )

    def close(self) -> None:
        self._http.close()
