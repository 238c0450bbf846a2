"""`tempering serve MODEL`: an OpenAI-compatible server over a local model.

    GET  /v1/models              the one model served (its name is the MODEL argument)
    POST /v1/chat/completions    messages -> the model's chat format (`inference.chat`); `stream: true` for SSE
    POST /v1/completions         a text prompt, continued as it is
    GET  /metrics                Prometheus text (requests, latency, tokens, batch sizes, cancellations)
    GET  /health                 answered on the event loop, whatever the load
    POST /v1/sessions            with --sessions: a recording session (`sessions.py`); /{id}/reward, /close

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
which clients send as their API key (`Authorization: Bearer ...`); the guard the sandbox service uses too
(`tempering.http`) checks it and caps request bodies. Every error is OpenAI's JSON shape ({"error": {"message", "type", "param", "code"}},
`code` a string or null), its own (401, 413, 429) as well as an unknown path (404) or method (405).

Engine: any request engine (`inference.protocol.RequestEngine`: submit, start, close); how many rows it
decodes together and who hears each step's batch size are its own constructor arguments (`tempering serve
--max-batch`, the server's metrics), set when the model is opened.

Layout: `OpenAIServer` holds one server's state (the model and its engine, the caps, the admission, the
metrics, the log) and has one short method per route, put on FastAPI in `OpenAIServer.app` behind the ASGI
layers of `asgi.py`; `create_app` builds one and returns its ASGI app. The request bodies, the caps
(`ServeLimits`) and the checks made before tokenizing, the error shape (`Refused`) and the answers' shapes
(`ChatReply`, `CompletionReply`) are in `openai_api.py`; a choice on the engine is `serving.Job`.

(No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at run time.)
"""

import asyncio
import dataclasses
import gc
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tempering.agent.asgi import Gate, Observe, guard_error
from tempering.agent.backends import LocalModel
from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.agent.openai_api import (
    DEFAULT_MAX_TOKENS,
    ChatReply,
    ChatRequest,
    CompletionReply,
    CompletionRequest,
    Refused,
    SamplingRequest,
    ServeLimits,
    TokenText,
    check_request,
    error_response,
    request_messages,
    usage,
)
from tempering.agent.serving import Job, disconnected, on_loop
from tempering.agent.sessions import (
    KEY_PREFIX,
    Call,
    RewardRequest,
    SessionLimits,
    SessionStore,
    chat_key,
    text_prompt,
)
from tempering.errors import TemperingError
from tempering.http import MIN_TOKEN_CHARS, Admission, Guard, is_loopback

TOKEN_ENV, TOKEN_FILE_ENV = "TEMPERING_SERVE_TOKEN", "TEMPERING_SERVE_TOKEN_FILE"


def _bearer(request: Request) -> str:
    return request.headers.get("authorization", "").removeprefix("Bearer ")


Reply = ChatReply | CompletionReply
"""How a request's answer reads, whole or streamed (`openai_api.py`)."""


class OpenAIServer:
    """One `tempering serve`: the model and its engine, the caps, the admission, the metrics and the log,
    and the routes, one method each. `app()` puts the routes on FastAPI behind the ASGI layers (call it
    once: it starts the engine)."""

    def __init__(
        self,
        chat: LocalModel,
        *,
        token: str | None = None,
        log_path: str | None = None,
        alert: AlertRule | None = None,
        limits: ServeLimits | None = None,
        metrics: Metrics | None = None,
        sessions: SessionLimits | None = None,
    ):
        limits = limits or ServeLimits()
        self.chat, self.engine, self.token, self.alert, self.limits = chat, chat.engine, token, alert, limits
        self.metrics = metrics or (alert.metrics if alert and alert.metrics else Metrics())
        self.admission = Admission(limits.max_pending, limits.client_pending, noun="requests", who="server")
        self.tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.log = JsonLog(log_path)
        self.created = int(time.time())
        self.token_entry = TokenText(chat.tokenizer).entry
        self.sessions = SessionStore(chat, sessions) if sessions else None
        """Recording sessions (`sessions.py`), when this server records them."""

    def app(self):
        """The ASGI app (behind the shared token and body-size guard, `http.Guard`). Starts the engine's loop on
        a thread of its own (continuous batching); the app's shutdown closes it."""
        app = self.routes()
        app.router.on_shutdown.extend([self.engine.close, self.tokenizing.shutdown])
        app.state.engine, app.state.metrics = self.engine, self.metrics
        self.engine.start()  # last: nothing after it can fail and leave its thread running
        observed = Observe(Gate(app, self.admission), self.metrics, self.log, self.alert)
        accepts = self.sessions.accepts if self.sessions else None
        return Guard(observed, self.token, self.limits.max_request_bytes, error=guard_error, accepts=accepts)

    def routes(self) -> FastAPI:
        """The routes and error handlers on FastAPI, nothing started: `app` serves them; the HTTP reference
        (tools/gen_docs.py) reads their OpenAPI schema, which needs none of the server's state."""
        app = FastAPI(title="tempering serve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(RequestValidationError, self.invalid)
        app.add_exception_handler(Refused, self.refused)
        app.add_exception_handler(StarletteHTTPException, self.no_route)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route(
            "/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None
        )
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        app.add_api_route("/v1/sessions", self.session_open, methods=["POST"])
        app.add_api_route("/v1/sessions/{sid}/reward", self.session_reward, methods=["POST"])
        app.add_api_route("/v1/sessions/{sid}/close", self.session_close, methods=["POST"])
        return app

    # Errors, as OpenAI shapes them.

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        """A body its model refuses: a 400 naming the first field at fault."""
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    async def refused(self, request: Request, exc: Refused) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.code, exc.headers, exc.param)

    async def no_route(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """An unknown path (404) or method (405), as OpenAI words it."""
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})", 405: f"method not allowed ({where})"}
        text = message.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, text, headers=exc.headers)

    # The routes.

    async def health(self) -> dict[str, Any]:
        """Liveness, answered on the event loop whatever the load: the model's name and the requests pending."""
        return {"status": "ok", "model": self.chat.name, "pending": self.admission.total}

    def prometheus(self) -> Response:
        """Prometheus text: requests, latency, tokens, batch sizes, cancellations."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def models(self) -> dict[str, Any]:
        """The one model served (its id is the MODEL argument of `tempering serve`)."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.chat.name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "tempering",
                    "max_model_len": self.chat.max_context,
                }
            ],
        }

    async def chat_completions(self, body: ChatRequest, request: Request):
        """OpenAI's chat completions: the messages in the model's chat format; `stream: true` for server-sent
        events."""
        if body.top_logprobs is not None and not body.logprobs:
            raise Refused(400, "top_logprobs: needs logprobs: true")
        messages = request_messages(body.messages)

        def render() -> list[int]:
            try:
                return self.chat.render(messages)
            except ValueError as e:
                raise Refused(400, str(e)) from None

        top = (body.top_logprobs or 0) if body.logprobs else None
        call = self.session_call(request, body.n, chat_key(messages), render, messages)
        chars = sum(len(m["content"]) for m in messages)
        jobs = await self.admitted(request, body, chars, top, call.tokenize if call else render, call)
        reply = ChatReply(self.chat.name, self.token_entry if body.logprobs else None)
        return await self.answer(request, body, jobs, reply)

    async def completions(self, body: CompletionRequest, request: Request):
        """OpenAI's (legacy) completions: a text prompt, or a list of token ids, continued as it is."""
        tokenizer = self.chat.tokenizer
        if isinstance(body.prompt, list):
            vocab = len(tokenizer)
            if not body.prompt or any(not 0 <= t < vocab for t in body.prompt):
                raise Refused(400, f"prompt: token ids must be a non-empty list in [0, {vocab})")
        key, tokens = text_prompt(tokenizer, body.prompt)
        call = self.session_call(request, body.n, key, tokens)
        top = body.logprobs
        jobs = await self.admitted(
            request, body, len(body.prompt), top, call.tokenize if call else tokens, call
        )
        reply = CompletionReply(self.chat.name, tokenizer, body.logprobs is not None, body.return_token_ids)
        return await self.answer(request, body, jobs, reply)

    # Recording sessions (`sessions.py`).

    def store(self) -> SessionStore:
        if self.sessions is None:
            raise Refused(404, "this server records no sessions (start it with --sessions)")
        return self.sessions

    async def session_open(self, request: Request) -> dict[str, str]:
        """A recording session: its id, the base URL its agent calls, and its API key."""
        session = self.store().create()
        return {
            "id": session.id,
            "base_url": f"{str(request.base_url).rstrip('/')}/v1",
            "api_key": session.key,
        }

    async def session_reward(self, sid: str, body: RewardRequest, request: Request) -> dict[str, Any]:
        """Attach a reward to a turn of the session (its last by default); needs the session's key."""
        return self.store().reward(self.store().owned(sid, _bearer(request)), body.reward, body.turn)

    async def session_close(self, sid: str, request: Request) -> dict[str, Any]:
        """End the session (needs its key): its branches' records, also kept for the trainer."""
        session = self.store().owned(sid, _bearer(request))
        records = await asyncio.get_running_loop().run_in_executor(
            self.tokenizing, self.sessions.close, session
        )
        return {"id": sid, "records": [dataclasses.asdict(r) for r in records]}

    def session_call(self, request: Request, n: int, key, tokens, messages=None) -> Call | None:
        """The call as its session records it, or None for a call made without a session key."""
        given = _bearer(request)
        if self.sessions is None or not given.startswith(KEY_PREFIX):
            return None
        return self.sessions.call(self.sessions.authorize(given), key, n, tokens, messages)

    # A completion request, from its body to its answer.

    async def admitted(
        self,
        request: Request,
        body: SamplingRequest,
        chars: int,
        top: int | None,
        tokenize: Callable[[], list[int]],
        call: Call | None = None,
    ) -> list[Job]:
        """Checked, admitted (429 past the caps) and tokenized (off the event loop): the request's jobs, not
        submitted yet - `answer` submits them once it listens to them."""
        stop = check_request(
            body, chars, top, model=self.chat.name, max_context=self.chat.max_context, limits=self.limits
        )
        client = call.client if call else request.client.host if request.client else "?"
        self.enter(client, body.n)
        prompt, room = await self.tokenized(client, body.n, tokenize)
        wanted = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        seed = body.seed if body.seed is not None else time.time_ns() % (1 << 31)
        temperature, top_p, wanted = body.temperature, body.top_p, min(wanted, room)
        if call:
            temperature, top_p, wanted, seed = call.sampled(temperature, top_p, wanted, seed)
        jobs = [
            Job(
                prompt,
                max_tokens=wanted,
                temperature=temperature,
                top_p=top_p,
                seed=(seed + i) % (1 << 64),
                stop=stop,
                logprobs=top,
                client=client,
            )
            for i in range(body.n)
        ]
        for job in jobs:  # each gives its room back when the engine is done with it (or it was cancelled)
            job.done.add_done_callback(lambda _, c=client: self.admission.leave(c, 1))
        if call:
            call.watch(jobs[0])
        return jobs

    def enter(self, client: str, n: int) -> None:
        """Room taken for `n` more of `client`'s, or the admission's refusal (429, 413) in OpenAI's shape."""
        try:
            self.admission.enter(client, n)
        except HTTPException as e:
            limited = e.status_code == 429
            raise Refused(
                e.status_code,
                e.detail,
                code="rate_limit_exceeded" if limited else None,
                kind="rate_limit_error" if limited else "invalid_request_error",
                headers=e.headers,
            ) from None

    async def tokenized(
        self, client: str, n: int, tokenize: Callable[[], list[int]]
    ) -> tuple[list[int], int]:
        """The prompt's ids (tokenized off the event loop) and the room the context leaves after them; on any
        failure the `n` admitted are given back."""
        try:
            prompt = await asyncio.get_running_loop().run_in_executor(self.tokenizing, tokenize)
            room = self.chat.max_context - len(prompt)
            if room <= 0:
                raise Refused(
                    400,
                    f"the prompt is {len(prompt)} tokens; this model's context is {self.chat.max_context}",
                    code="context_length_exceeded",
                )
        except BaseException:
            self.admission.leave(client, n)
            raise
        return prompt, room

    async def answer(self, request: Request, body: SamplingRequest, jobs: list[Job], reply: Reply):
        """The jobs submitted, and their answer: whole once all are done, or streamed as they go."""
        if body.stream:
            return self.streamed(jobs, reply, bool((body.stream_options or {}).get("include_usage")))
        return await self.whole(request, jobs, reply)

    async def whole(self, request: Request, jobs: list[Job], reply: Reply):
        """Submits the jobs and answers once all are done; a client that hangs up first cancels them (499)."""
        loop = asyncio.get_running_loop()
        for job in jobs:
            job.submit(self.engine)
        everything = asyncio.gather(*(on_loop(j.done, loop) for j in jobs))
        gone = asyncio.ensure_future(disconnected(request))
        await asyncio.wait({everything, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():  # the client hung up: its rows leave the batch at the next step
            for j in jobs:
                j.cancel()
            self.metrics.cancelled.inc(len(jobs))
            everything.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody waits on it now
            return Response(status_code=499)
        gone.cancel()
        everything.result()  # an engine error: a 500
        self.count(jobs)
        return reply.whole(jobs)

    def streamed(self, jobs: list[Job], reply: Reply, with_usage: bool) -> StreamingResponse:
        """Listens to the jobs, then submits them: their text as server-sent events as it becomes final."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        put = events.put_nowait
        for i, job in enumerate(jobs):
            job.listen(lambda delta, entries, i=i: loop.call_soon_threadsafe(put, (i, delta, entries)))
            job.done.add_done_callback(lambda _, i=i: loop.call_soon_threadsafe(put, (i, None, None)))
            job.submit(self.engine)  # only now: a job can be done before `submit` returns, its text unheard
        return StreamingResponse(self.chunks(jobs, events, reply, with_usage), media_type="text/event-stream")

    async def chunks(self, jobs: list[Job], events: asyncio.Queue, reply: Reply, with_usage: bool):
        """The stream: each choice's opening chunk, its text as heard, its finish reason; the usage if asked;
        `[DONE]`. A stream that ends before its jobs (the client hung up, or it broke) cancels them."""
        chunk, finished = reply.chunk, 0
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
            self.count(jobs)
            if with_usage:
                last = {**chunk(0, None, [], None), "choices": [], "usage": usage(jobs)}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if finished < len(jobs):  # the client hung up (or the stream broke)
                for j in jobs:
                    j.cancel()
                self.metrics.cancelled.inc(len(jobs) - finished)

    def count(self, jobs: list[Job]) -> None:
        self.metrics.prompt_tokens.inc(len(jobs[0].prompt))
        self.metrics.completion_tokens.inc(sum(j.completion_tokens for j in jobs))


def create_app(chat: LocalModel, **options: Any):
    """The ASGI app of an `OpenAIServer(chat, **options)` (see `OpenAIServer.app`)."""
    return OpenAIServer(chat, **options).app()


def check_exposure(host: str, token: str | None) -> None:
    """A non-loopback address needs a token (checked before anything is loaded)."""
    if token is None and not is_loopback(host):
        raise TemperingError(
            f"refusing to serve on {host} without a token: set ${TOKEN_ENV} (or --token-file) to a "
            f"secret of at least {MIN_TOKEN_CHARS} characters and give it to clients as their API key"
        )


def serve(chat: LocalModel, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
    """Serve until interrupted (`options`: `OpenAIServer`'s). Refuses a non-loopback address without a token."""
    import uvicorn

    check_exposure(host, options.get("token"))
    app = create_app(chat, **options)
    # Everything loaded so far (torch, transformers, the model) is never garbage: out of the collector's
    # sight, a full collection no longer walks it - measured, it was what stalled /health for ~0.2 s in a
    # flood of 300 requests (bench/serve_throughput.py).
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
