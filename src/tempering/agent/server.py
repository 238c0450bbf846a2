"""`tempering serve MODEL`: an OpenAI-compatible server over a local model.

    GET  /v1/models              the one model served (its name is the MODEL argument)
    POST /v1/chat/completions    messages -> the model's chat format (`rollout.chat`); `stream: true` for SSE
    POST /v1/completions         a text prompt, continued as it is
    GET  /metrics                Prometheus text (requests, latency, tokens, batch sizes)
    GET  /health

Batching: one thread generates. Requests that arrive while it is busy queue up, and the next batch takes
all of them (up to `max_batch`), grouped by sampling parameters: under load every generation is a batch.
(Static batching: a request waits for the running batch to finish; vLLM's continuous batching would let
it join mid-way.) A streamed request gets its tokens as the batch produces them. `seed` seeds the batch
its request lands in, so a seeded request repeats exactly only when it is alone.

Exposure: loopback by default; any other address needs a token ($TEMPERING_SERVE_TOKEN or --token-file),
which clients send as their API key (`Authorization: Bearer ...`); the sandbox service's guard checks it
and caps request bodies. Errors are OpenAI's JSON shape ({"error": {"message", "type", "code"}}).

(No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at run time.)
"""

import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from tempering.agent.backends import Completion, LocalChat
from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.errors import TemperingError

TOKEN_ENV, TOKEN_FILE_ENV = "TEMPERING_SERVE_TOKEN", "TEMPERING_SERVE_TOKEN_FILE"
DEFAULT_MAX_TOKENS = 256


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send more fields than a local model uses

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    seed: int | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    future: Future = field(default_factory=Future)
    on_token: Callable[[int], None] | None = None
    """Streaming: hears each new token id (the stop token included)."""


class Batcher:
    """Feeds queued jobs to the model in batches, in one background thread."""

    def __init__(self, chat: LocalChat, metrics: Metrics, max_batch: int = 32):
        self.chat, self.metrics, self.max_batch = chat, metrics, max_batch
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Future:
        self.jobs.put(job)
        return job.future

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while (first := self.jobs.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self.jobs.put(None)
                    break
                batch.append(job)
            groups: dict[tuple, list[Job]] = {}
            for job in batch:
                groups.setdefault((job.temperature, job.top_p), []).append(job)
            for (temperature, top_p), jobs in groups.items():
                self._generate(jobs, temperature, top_p)

    def _generate(self, jobs: list[Job], temperature: float, top_p: float) -> None:
        self.metrics.batch_size.observe(len(jobs))
        listeners = [j.on_token for j in jobs]

        def on_tokens(rows: list[int], tokens: list[int]) -> None:
            for row, token in zip(rows, tokens):
                if listeners[row]:
                    listeners[row](token)

        try:
            out = self.chat.generate([j.prompt for j in jobs], max_tokens=[j.max_tokens for j in jobs],
                                     temperature=temperature, top_p=top_p, seed=jobs[0].seed,
                                     on_tokens=on_tokens if any(listeners) else None)
        except Exception as e:  # noqa: BLE001 - every waiting request hears it
            for j in jobs:
                j.future.set_exception(e)
            return
        for j, completion in zip(jobs, out):
            j.future.set_result(completion)


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code or status}}, status_code=status)


def _text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts (their text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


class _Stream:
    """Turns a job's token ids into text deltas: decodes what it has and sends the part not sent yet
    (holding back a partial UTF-8 character, which decodes as U+FFFD)."""

    def __init__(self, tokenizer, stops: set[int], loop: asyncio.AbstractEventLoop, limit: int):
        self.tokenizer, self.stops, self.loop, self.limit = tokenizer, stops, loop, limit
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids: list[int] = []
        self.sent = ""
        self.closed = False

    def on_token(self, token: int) -> None:  # in the batcher's thread
        if self.closed or len(self.ids) >= self.limit:
            return
        if token in self.stops:
            self.closed = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return
        delta, self.sent = text[len(self.sent):], text
        if delta:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)


def create_app(chat: LocalChat, *, token: str | None = None, log_path: str | None = None,
               alert: AlertRule | None = None, max_batch: int = 32, max_request_bytes: int = 8 << 20):
    """The ASGI app (behind the sandbox service's token and body-size guard)."""
    from tempering.sandbox.app import Guard

    metrics = alert.metrics if alert and alert.metrics else Metrics()
    batcher = Batcher(chat, metrics, max_batch)
    log = JsonLog(log_path)
    app = FastAPI(title="tempering serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.on_shutdown.append(batcher.close)
    app.state.batcher, app.state.metrics = batcher, metrics
    created = int(time.time())
    stops = set(chat.engine.stop_ids)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}")

    @app.middleware("http")
    async def observe(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        endpoint = request.url.path
        if endpoint != "/metrics":
            seconds = time.perf_counter() - started
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
            metrics.request_seconds.labels(endpoint).observe(seconds)
            log.write({"event": "request", "time": time.time(), "endpoint": endpoint, "status": response.status_code,
                       "latency_s": round(seconds, 4), "client": request.client.host if request.client else None})
            if alert:
                alert.observe(response.status_code < 500, endpoint=endpoint)
        return response

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": chat.name, "queued": batcher.jobs.qsize()}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": chat.name, "object": "model", "created": created,
                                            "owned_by": "tempering", "max_model_len": chat.max_context}]}

    def job_for(body: _Sampling, prompt: list[int]) -> Job | JSONResponse:
        if body.model not in (None, chat.name):
            return _error(404, f"model '{body.model}' is not served here; this server serves '{chat.name}'",
                          "not_found_error")
        room = chat.max_context - len(prompt)
        if room <= 0:
            return _error(400, f"the prompt is {len(prompt)} tokens; this model's context is {chat.max_context}",
                          code="context_length_exceeded")
        wanted = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        return Job(prompt, min(wanted, room), body.temperature, body.top_p,
                   body.seed if body.seed is not None else time.time_ns() % (1 << 31))

    async def answer(job: Job, stream: bool, shape: Callable[[Completion], dict],
                     chunk: Callable[[str | None, str | None], dict]):
        if not stream:
            completion = await asyncio.wrap_future(batcher.submit(job))
            metrics.prompt_tokens.inc(completion.prompt_tokens)
            metrics.completion_tokens.inc(completion.completion_tokens)
            return shape(completion)
        streamer = _Stream(chat.tokenizer, stops, asyncio.get_running_loop(), job.max_tokens)
        job.on_token = streamer.on_token
        done = asyncio.wrap_future(batcher.submit(job))

        async def events():
            yield f"data: {json.dumps(chunk('', None))}\n\n"
            while not (done.done() and streamer.queue.empty()):
                getter = asyncio.ensure_future(streamer.queue.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    yield f"data: {json.dumps(chunk(getter.result(), None))}\n\n"
                else:
                    getter.cancel()
            completion = done.result()
            rest = completion.text[len(streamer.sent):] if completion.text.startswith(streamer.sent) else ""
            metrics.prompt_tokens.inc(completion.prompt_tokens)
            metrics.completion_tokens.inc(completion.completion_tokens)
            yield f"data: {json.dumps(chunk(rest or None, completion.finish_reason))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def usage(c: Completion) -> dict[str, int]:
        return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                "total_tokens": c.prompt_tokens + c.completion_tokens}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest):
        messages = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in body.messages]
        try:
            prompt = chat.render(messages)
        except ValueError as e:
            return _error(400, str(e))
        job = job_for(body, prompt)
        if isinstance(job, JSONResponse):
            return job
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def shape(c: Completion) -> dict:
            return {"id": rid, "object": "chat.completion", "created": now, "model": chat.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                                 "finish_reason": c.finish_reason, "logprobs": None}], "usage": usage(c)}

        def chunk(text: str | None, finish: str | None) -> dict:
            delta = {} if text is None else {"role": "assistant", "content": text} if text == "" else {"content": text}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": chat.name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        return await answer(job, body.stream, shape, chunk)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest):
        from tempering.rollout.generate import encode_prompt

        job = job_for(body, encode_prompt(chat.tokenizer, body.prompt))
        if isinstance(job, JSONResponse):
            return job
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def shape(c: Completion) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": chat.name,
                    "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}],
                    "usage": usage(c)}

        def chunk(text: str | None, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": chat.name,
                    "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

        return await answer(job, body.stream, shape, chunk)

    return Guard(app, token, max_request_bytes)


def check_exposure(host: str, token: str | None) -> None:
    """A non-loopback address needs a token (checked before anything is loaded)."""
    from tempering.sandbox.service import MIN_TOKEN_CHARS, is_loopback

    if token is None and not is_loopback(host):
        raise TemperingError(f"refusing to serve on {host} without a token: set ${TOKEN_ENV} (or --token-file) to a "
                             f"secret of at least {MIN_TOKEN_CHARS} characters and give it to clients as their API key")


def serve(chat: LocalChat, host: str = "127.0.0.1", port: int = 8000, *, token: str | None = None,
          log_path: str | None = None, alert: AlertRule | None = None, max_batch: int = 32) -> None:
    """Serve until interrupted. Refuses a non-loopback address without a token."""
    import uvicorn

    check_exposure(host, token)
    app = create_app(chat, token=token, log_path=log_path, alert=alert, max_batch=max_batch)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
