"""`tempering serve MODEL`: an OpenAI-compatible server over a local model.

    GET  /v1/models              the one model served (its name is the MODEL argument)
    POST /v1/chat/completions    messages -> the model's chat format (`rollout.chat`); `stream: true` for SSE
    POST /v1/completions         a text prompt, continued as it is
    GET  /metrics                Prometheus text (requests, latency, tokens, batch sizes, cancellations)
    GET  /health                 answered on the event loop, whatever the load

OpenAI's request fields that are implemented: `max_tokens` / `max_completion_tokens`, `temperature` (0 =
greedy), `top_p`, `n`, `seed` (per request: a seeded request draws the same numbers whichever requests
share its batch), `stop` (up to 4 strings of up to `ServeLimits.max_stop_chars` - 1024 - characters each:
the text is cut before the first, finish_reason `stop`, also while streaming), `logprobs` / `top_logprobs`
(the sampled tokens' log-probs under the model's own distribution, as vLLM reports them by default, with up
to 5 alternatives; `bytes` are the token's own, a byte token's one byte), `stream` and
`stream_options.include_usage`; `null` for any of them means its default, as at OpenAI. Fields that do not
change the output (`user`, `metadata`, ...) are accepted; any other field that would change it - penalties,
`logit_bias`, `tools`, `response_format` other than text, `echo`, a message part other than text (an
image, audio, a file) ... - is a 400 naming it, never silently ignored.

Admission (`ServeLimits`): past `max_pending` requests in all, or `client_pending` of one client (by
address), a request gets 429 with Retry-After before its prompt is even tokenized; `n`, `max_tokens`,
`top_logprobs`, the stop strings and the prompt have caps (an OpenAI-shaped 400). The prompt's length is
checked cheaply (characters) before it is tokenized, and tokenizing runs off the event loop, so a huge
prompt cannot stall the server. A client that hangs up - streaming or not - cancels its request: a queued
one never runs, a running one leaves its batch at the next decode step (`serving.py`).

Exposure: loopback by default; any other address needs a token ($TEMPERING_SERVE_TOKEN or --token-file),
which clients send as their API key (`Authorization: Bearer ...`); the sandbox service's guard checks it
and caps request bodies. Every error is OpenAI's JSON shape ({"error": {"message", "type", "param", "code"}},
`code` a string or null), its own (401, 413, 429) as well as an unknown path (404) or method (405).

(No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at run time.)
"""

import asyncio
import functools
import gc
import json
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tempering.agent.backends import LocalModel
from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.agent.openai_api import (
    DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    message_text,
    unsupported,
)
from tempering.agent.serving import Job, TokenLogprob, token_bytes
from tempering.errors import TemperingError

TOKEN_ENV, TOKEN_FILE_ENV = "TEMPERING_SERVE_TOKEN", "TEMPERING_SERVE_TOKEN_FILE"


@dataclass(frozen=True)
class ServeLimits:
    max_pending: int = 256
    """Requests (choices) queued or generating at once; more get 429."""
    client_pending: int = 64
    """Requests one client (by address) may have queued or generating; more get 429."""
    max_n: int = 8
    """Most choices per request."""
    max_tokens: int | None = None
    """Most new tokens a request may ask for (None: the model's context)."""
    max_top_logprobs: int = 5
    max_stop_chars: int = 1024
    """Longest stop string in characters (OpenAI takes up to 4 stop strings a request)."""
    chars_per_token: int = 16
    """A prompt of more characters than the context times this is refused before it is tokenized."""
    max_request_bytes: int = 2 << 20
    """Largest request body (413 past it, before it is read)."""


class Refused(Exception):
    """A request answered with an OpenAI-shaped error before any generation."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.headers = status, message, code, kind, headers
        self.param = param


def _error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
                param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
           headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, code, param), status_code=status, headers=headers)


def _guard_error(status: int, detail: str) -> dict:
    """The body of the guard's own refusals (401: no or a wrong API key; 413: the body is too large)."""
    return _error_body(detail, code="invalid_api_key" if status == 401 else None)


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
            return await _error(429, why, "rate_limit_error", "rate_limit_exceeded", {"Retry-After": "1"})(
                scope, receive, send)
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
            self.log.write({"event": "request", "time": time.time(), "endpoint": endpoint, "status": status[0],
                            "latency_s": round(seconds, 4), "client": client[0] if client else None})
            if self.alert:
                self.alert.observe(status[0] < 500, endpoint=endpoint)


def _messages(given: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The request's messages as role and text; a content part that is not text is refused by name."""
    out = []
    for i, m in enumerate(given):
        try:
            out.append({"role": m.get("role"), "content": message_text(m.get("content"))})
        except ValueError as e:
            raise Refused(400, f"messages[{i}].{e}", code="unsupported_value", param=f"messages[{i}].content") from None
    return out


def _on_loop(future, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """An asyncio future that completes with a job's `done` (set in the engine's thread). Unlike
    `asyncio.wrap_future`, cancelling it never cancels the job's own future under the engine."""
    out = loop.create_future()

    def copy(f) -> None:
        if out.done():
            return
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result())

    future.add_done_callback(lambda f: loop.call_soon_threadsafe(copy, f))
    return out


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (after the body, the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(chat: LocalModel, *, token: str | None = None, log_path: str | None = None,
               alert: AlertRule | None = None, max_batch: int = 32, limits: ServeLimits = ServeLimits()):
    """The ASGI app (behind the sandbox service's token and body-size guard)."""
    from tempering.rollout.generate import encode_prompt
    from tempering.sandbox.app import Admission, Guard

    if max_batch < 1:
        raise ValueError(f"max_batch {max_batch}: at least one row is needed to generate anything")
    metrics = alert.metrics if alert and alert.metrics else Metrics()
    admission = Admission(limits.max_pending, limits.client_pending, noun="requests", who="server")
    engine = chat.engine
    engine.scheduler.max_rows, engine.scheduler.on_step = max_batch, metrics.batch_size.observe
    engine.start()  # continuous batching on the engine's own thread
    tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
    app = FastAPI(title="tempering serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.on_shutdown.extend([engine.close, tokenizing.shutdown])
    app.state.engine, app.state.metrics = engine, metrics
    created = int(time.time())
    max_tokens_cap = limits.max_tokens or chat.max_context

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.code, exc.headers, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """An unknown path (404) or method (405), as OpenAI words it."""
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})", 405: f"method not allowed ({where})"}
        return _error(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=exc.headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": chat.name, "pending": admission.total}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": chat.name, "object": "model", "created": created,
                                            "owned_by": "tempering", "max_model_len": chat.max_context}]}

    def check(body: SamplingRequest, chars: int, top: int | None) -> list[str]:
        """Everything that can be refused before tokenizing; returns the stop strings."""
        if body.model not in (None, chat.name):
            raise Refused(404, f"model '{body.model}' is not served here; this server serves '{chat.name}'",
                          code="model_not_found", param="model")
        if (field := unsupported(body)) is not None:
            raise Refused(400, f"'{field}' is not supported by this server (it would change the output)",
                          code="unsupported_parameter", param=field)
        if body.n > limits.max_n:
            raise Refused(400, f"n: at most {limits.max_n} choices per request", param="n")
        wanted = body.max_completion_tokens or body.max_tokens or 0
        if wanted > max_tokens_cap:
            raise Refused(400, f"max_tokens: at most {max_tokens_cap} here", param="max_tokens")
        if top is not None and top > limits.max_top_logprobs:
            raise Refused(400, f"top_logprobs: at most {limits.max_top_logprobs} here", param="top_logprobs")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4:
            raise Refused(400, "stop: at most 4 sequences", param="stop")
        if (longest := max(map(len, stop), default=0)) > limits.max_stop_chars:
            raise Refused(400, f"stop: each sequence at most {limits.max_stop_chars} characters here (one has "
                               f"{longest})", param="stop")
        if chars > chat.max_context * limits.chars_per_token:
            raise Refused(400, f"the prompt is {chars} characters, more than this model's context of "
                               f"{chat.max_context} tokens can hold", code="context_length_exceeded")
        return stop

    async def admitted(request: Request, body: SamplingRequest, chars: int, top: int | None,
                       tokenize: Callable[[], list[int]]) -> list[Job]:
        """Checked, admitted (429 past the caps) and tokenized (off the event loop): the request's jobs, not
        submitted yet - `answer` submits them once it listens to them."""
        stop = check(body, chars, top)
        client = request.client.host if request.client else "?"
        try:
            admission.enter(client, body.n)
        except HTTPException as e:
            raise Refused(e.status_code, e.detail, code="rate_limit_exceeded" if e.status_code == 429 else None,
                          kind="rate_limit_error" if e.status_code == 429 else "invalid_request_error",
                          headers=e.headers) from None
        try:
            prompt = await asyncio.get_running_loop().run_in_executor(tokenizing, tokenize)
            room = chat.max_context - len(prompt)
            if room <= 0:
                raise Refused(400, f"the prompt is {len(prompt)} tokens; this model's context is {chat.max_context}",
                              code="context_length_exceeded")
        except BaseException:
            admission.leave(client, body.n)
            raise
        wanted = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        seed = body.seed if body.seed is not None else time.time_ns() % (1 << 31)
        jobs = [Job(prompt, max_tokens=min(wanted, room), temperature=body.temperature, top_p=body.top_p,
                    seed=(seed + i) % (1 << 64), stop=stop, logprobs=top, client=client) for i in range(body.n)]
        for job in jobs:  # each gives its room back when the engine is done with it (or it was cancelled)
            job.done.add_done_callback(lambda _, c=client: admission.leave(c, 1))
        return jobs

    async def answer(request: Request, body: SamplingRequest, jobs: list[Job], shape: Callable[[list[Job]], dict],
                     chunk: Callable[[int, str | None, list[TokenLogprob], str | None], dict]):
        loop = asyncio.get_running_loop()
        if not body.stream:
            for job in jobs:
                job.submit(engine)
            everything = asyncio.gather(*(_on_loop(j.done, loop) for j in jobs))
            gone = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not everything.done():  # the client hung up: its rows leave the batch at the next step
                for j in jobs:
                    j.cancel()
                metrics.cancelled.inc(len(jobs))
                everything.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits on it now
                return Response(status_code=499)
            gone.cancel()
            everything.result()  # an engine error: a 500
            count(jobs)
            return shape(jobs)
        events: asyncio.Queue = asyncio.Queue()
        for i, job in enumerate(jobs):
            job.listen(lambda delta, entries, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, delta, entries)))
            job.done.add_done_callback(lambda _, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, None, None)))
            job.submit(engine)  # only now: a job can be done before `submit` returns, its text unheard
        usage = bool((body.stream_options or {}).get("include_usage"))

        async def stream():
            finished = 0
            try:
                for i in range(len(jobs)):
                    yield f"data: {json.dumps(chunk(i, '', [], None))}\n\n"
                while finished < len(jobs):
                    i, delta, entries = await events.get()
                    if delta is None:  # the job is done: its finish reason (or its error, a broken stream)
                        finished += 1
                        jobs[i].done.result()
                        yield f"data: {json.dumps(chunk(i, None, [], jobs[i].finish_reason))}\n\n"
                    else:
                        yield f"data: {json.dumps(chunk(i, delta, entries, None))}\n\n"
                count(jobs)
                if usage:
                    yield f"data: {json.dumps({**chunk(0, None, [], None), 'choices': [], 'usage': totals(jobs)})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if finished < len(jobs):  # the client hung up (or the stream broke)
                    for j in jobs:
                        j.cancel()
                    metrics.cancelled.inc(len(jobs) - finished)

        return StreamingResponse(stream(), media_type="text/event-stream")

    def count(jobs: list[Job]) -> None:
        metrics.prompt_tokens.inc(len(jobs[0].prompt))
        metrics.completion_tokens.inc(sum(j.completion_tokens for j in jobs))

    def totals(jobs: list[Job]) -> dict[str, int]:
        done = sum(j.completion_tokens for j in jobs)
        return {"prompt_tokens": len(jobs[0].prompt), "completion_tokens": done,
                "total_tokens": len(jobs[0].prompt) + done}

    @functools.lru_cache(maxsize=4096)
    def token_text(token: int) -> tuple[str, bytes]:
        """A token's text and its own bytes (a byte token's one byte, not its text's U+FFFD)."""
        return chat.tokenizer.decode([token], skip_special_tokens=False), token_bytes(chat.tokenizer, token)

    def token_entry(entry: TokenLogprob) -> dict:
        def one(token: int, logprob: float) -> dict:
            text, raw = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest, request: Request):
        if body.top_logprobs is not None and not body.logprobs:
            raise Refused(400, "top_logprobs: needs logprobs: true")
        messages = _messages(body.messages)

        def render() -> list[int]:
            try:
                return chat.render(messages)
            except ValueError as e:
                raise Refused(400, str(e)) from None

        top = (body.top_logprobs or 0) if body.logprobs else None
        jobs = await admitted(request, body, sum(len(m["content"]) for m in messages), top, render)
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def logprobs(entries: list[TokenLogprob]) -> dict | None:
            return {"content": [token_entry(e) for e in entries]} if body.logprobs else None

        def shape(jobs: list[Job]) -> dict:
            return {"id": rid, "object": "chat.completion", "created": now, "model": chat.name,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": j.text},
                                 "finish_reason": j.finish_reason, "logprobs": logprobs(j.token_logprobs)}
                                for i, j in enumerate(jobs)], "usage": totals(jobs)}

        def chunk(i: int, text: str | None, entries: list[TokenLogprob], finish: str | None) -> dict:
            # The opening chunk ("", nothing else) names the role; the closing one (None) has no content.
            opening = text == "" and not entries and finish is None
            delta = {} if text is None else {"role": "assistant", "content": ""} if opening else {"content": text}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": chat.name,
                    "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                 "logprobs": logprobs(entries) if entries else None}]}

        return await answer(request, body, jobs, shape, chunk)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, list):
            vocab = len(chat.tokenizer)
            if not body.prompt or any(not 0 <= t < vocab for t in body.prompt):
                raise Refused(400, f"prompt: token ids must be a non-empty list in [0, {vocab})")
            ids = list(body.prompt)
            jobs = await admitted(request, body, len(ids), body.logprobs, lambda: ids)
        else:
            jobs = await admitted(request, body, len(body.prompt), body.logprobs,
                                  lambda: encode_prompt(chat.tokenizer, body.prompt))
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def logprobs(entries: list[TokenLogprob]) -> dict | None:
            if body.logprobs is None:
                return None
            tokens = [chat.tokenizer.decode([e.token], skip_special_tokens=False) for e in entries]
            offsets = [sum(map(len, tokens[:k])) for k in range(len(tokens))]
            tops = [{chat.tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in e.top} for e in entries]
            return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                    "text_offset": offsets}

        def shape(jobs: list[Job]) -> dict:
            ids = {"prompt_token_ids": jobs[0].prompt} if body.return_token_ids else {}
            return {"id": rid, "object": "text_completion", "created": now, "model": chat.name, **ids,
                    "choices": [{"index": i, "text": j.text, "finish_reason": j.finish_reason,
                                 "logprobs": logprobs(j.token_logprobs),
                                 **({"token_ids": j.ids} if body.return_token_ids else {})}
                                for i, j in enumerate(jobs)],
                    "usage": totals(jobs)}

        def chunk(i: int, text: str | None, entries: list[TokenLogprob], finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": chat.name,
                    "choices": [{"index": i, "text": text or "", "finish_reason": finish,
                                 "logprobs": logprobs(entries) if entries else None}]}

        return await answer(request, body, jobs, shape, chunk)

    return Guard(Observe(Gate(app, admission), metrics, JsonLog(log_path), alert), token, limits.max_request_bytes,
                 error=_guard_error)


def check_exposure(host: str, token: str | None) -> None:
    """A non-loopback address needs a token (checked before anything is loaded)."""
    from tempering.sandbox.service import MIN_TOKEN_CHARS, is_loopback

    if token is None and not is_loopback(host):
        raise TemperingError(f"refusing to serve on {host} without a token: set ${TOKEN_ENV} (or --token-file) to a "
                             f"secret of at least {MIN_TOKEN_CHARS} characters and give it to clients as their API key")


def check_address(host: str, port: int) -> None:
    """The server could listen on host:port - a host of this machine, no server there already - checked
    before anything is loaded (a model: minutes). The port's range is the CLI's `port_number`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as e:
        raise TemperingError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(chat: LocalModel, host: str = "127.0.0.1", port: int = 8000, *, token: str | None = None,
          log_path: str | None = None, alert: AlertRule | None = None, max_batch: int = 32,
          limits: ServeLimits = ServeLimits()) -> None:
    """Serve until interrupted. Refuses a non-loopback address without a token."""
    import uvicorn

    check_exposure(host, token)
    app = create_app(chat, token=token, log_path=log_path, alert=alert, max_batch=max_batch, limits=limits)
    # Everything loaded so far (torch, transformers, the model) is never garbage: out of the collector's
    # sight, a full collection no longer walks it - measured, it was what stalled /health for ~0.2 s in a
    # flood of 300 requests (bench/serve_throughput.py).
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
