"""The ASGI layers in front of `tempering serve`'s routes (`server.py`), outermost first: the guard's
refusals in OpenAI's error shape (`guard_error`, for `http.Guard`), every request observed into the
metrics, the log and the alert rule (`Observe`), and a full server's 429 before a body is parsed (`Gate`).
"""

import time

from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.agent.openai_api import error_body, error_response


def guard_error(status: int, detail: str) -> dict:
    """The body of the guard's own refusals (401: no or a wrong API key; 413: the body is too large)."""
    return error_body(detail, code="invalid_api_key" if status == 401 else None)


class Gate:
    """ASGI middleware: a completion request from a client with no room left (or when the server is full)
    gets its 429 here, before its body is parsed - a flood of them costs the event loop next to nothing, so
    `/health` and admitted requests are not queued behind it. (The exact check, with `n`, follows after
    parsing.)"""

    PATHS = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, app, admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send):
        client = (scope.get("client") or ("?",))[0]
        if scope["type"] == "http" and scope["path"] in self.PATHS and (why := self.admission.busy(client)):
            refusal = error_response(
                429, why, "rate_limit_error", "rate_limit_exceeded", {"Retry-After": "1"}
            )
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


class Observe:
    """ASGI middleware: every request's status and latency into the metrics, the JSON log and the alert
    rule (a plain ASGI wrapper rather than FastAPI's http middleware, which would wrap streaming bodies
    and the disconnect message)."""

    def __init__(self, app, metrics: Metrics, log: JsonLog, alert: AlertRule | None):
        self.app, self.metrics, self.log, self.alert = app, metrics, log, alert

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            endpoint, seconds = scope["path"], time.perf_counter() - started
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.request_seconds.labels(endpoint).observe(seconds)
            client = scope.get("client")
            self.log.write(
                {
                    "event": "request",
                    "time": time.time(),
                    "endpoint": endpoint,
                    "status": status[0],
                    "latency_s": round(seconds, 4),
                    "client": client[0] if client else None,
                }
            )
            if self.alert:
                self.alert.observe(status[0] < 500, endpoint=endpoint)
