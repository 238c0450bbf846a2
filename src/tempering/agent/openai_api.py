"""The OpenAI API as `tempering serve` speaks it; the server (`server.py`) holds the state and the routes.

- the request bodies (pydantic models), and which of OpenAI's fields are implemented, ignored as harmless, or
  refused (`unsupported`);
- the caps (`ServeLimits`) and everything checked before a prompt is tokenized (`check_request`,
  `request_messages`);
- OpenAI's error shape ({"error": {"message", "type", "param", "code"}}): `Refused`, raised anywhere in a
  route and answered by the app's handler, and `error_response`;
- the answers, whole or as stream chunks (`ChatReply`, `CompletionReply`, `usage`).
"""

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tempering.agent.serving import Job, TokenLogprob, token_bytes

DEFAULT_MAX_TOKENS = 256
HARMLESS = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
}
"""Request fields that do not change what is generated: accepted and ignored."""
NEUTRAL = {
    "presence_penalty": (0, None),
    "frequency_penalty": (0, None),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "modalities": (None, ["text"]),
}
"""Fields that would change the output, and the values of theirs that do not (accepted)."""


class SamplingRequest(BaseModel):
    # extra="allow": checked by `unsupported`, accepted only when harmless; the docstrings under the fields
    # are their descriptions in the HTTP reference (docs/reference/http.md)
    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    model: str | None = None
    """The served model's name, or unset; any other name is a 404."""
    max_tokens: int | None = Field(None, ge=1)
    """Longest completion, in tokens (unset: 256)."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """The same as max_tokens (OpenAI's newer name); this one wins when both are set."""
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """Sampling temperature; 0 = greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1 = off)."""
    n: int = Field(1, ge=1)
    """Choices to sample for the prompt."""
    stream: bool = False
    """Answer as server-sent events, text as it becomes final."""
    stream_options: dict[str, Any] | None = None
    """`{"include_usage": true}`: a last chunk with the token counts."""
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    """Seeds this request's sampling: the same numbers whichever requests share its batch."""
    stop: str | list[str] | None = None
    """Up to 4 strings; the text is cut before the first one found (finish_reason `stop`)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """`null` for a field means its default, as at OpenAI (`"temperature": null` samples at 1, `"n": null`
        is one choice); a required field stays required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None
        }


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    """The conversation: `{"role", "content"}` objects, content text (or text parts)."""
    logprobs: bool = False
    """Return the sampled tokens' log-probs."""
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """With logprobs: also this many most likely alternatives per token (past the server's cap, 5, a 400)."""


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(union_mode="left_to_right")
    """Text, or token ids (OpenAI's and vLLM's completions API take both)."""
    logprobs: int | None = Field(None, ge=0, le=5)
    """Return the sampled tokens' log-probs and this many most likely alternatives per token."""
    return_token_ids: bool = False
    """vLLM's extension: each choice also carries `token_ids` (its sampled ids, a stop token included)
    and the response `prompt_token_ids` - what an episode over HTTP appends to its context."""


def message_text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of parts, their texts joined. Any other part (an
    image, audio, a file) is a ValueError naming it: this server reads text only, and a part left out
    silently would answer a different prompt."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content[{j}]: a part of type '{kind}' is not supported here (text only)")
        return "".join(str(part.get("text", "")) for part in content)
    return "" if content is None else str(content)


def unsupported(body: SamplingRequest) -> str | None:
    """The first field the request sets that would change the output and is not implemented here (a field
    set to null asks for its default: it changes nothing)."""
    for name, value in (body.model_extra or {}).items():
        if value is None or name in HARMLESS or (name in NEUTRAL and value in NEUTRAL[name]):
            continue
        return name
    return None


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

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.headers = status, message, code, kind, headers
        self.param = param


def error_body(
    message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)


def request_messages(given: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The request's messages as role and text; a content part that is not text is refused by name."""
    out = []
    for i, m in enumerate(given):
        try:
            out.append({"role": m.get("role"), "content": message_text(m.get("content"))})
        except ValueError as e:
            raise Refused(
                400, f"messages[{i}].{e}", code="unsupported_value", param=f"messages[{i}].content"
            ) from None
    return out


def check_request(
    body: SamplingRequest, chars: int, top: int | None, *, model: str, max_context: int, limits: ServeLimits
) -> list[str]:
    """Everything that can be refused before tokenizing a prompt of `chars` characters for `model` (asking for
    `top` alternatives' log-probs, None: no log-probs); returns the stop strings."""
    if body.model not in (None, model):
        raise Refused(
            404,
            f"model '{body.model}' is not served here; this server serves '{model}'",
            code="model_not_found",
            param="model",
        )
    if (name := unsupported(body)) is not None:
        raise Refused(
            400,
            f"'{name}' is not supported by this server (it would change the output)",
            code="unsupported_parameter",
            param=name,
        )
    if body.n > limits.max_n:
        raise Refused(400, f"n: at most {limits.max_n} choices per request", param="n")
    max_tokens = limits.max_tokens or max_context
    if (body.max_completion_tokens or body.max_tokens or 0) > max_tokens:
        raise Refused(400, f"max_tokens: at most {max_tokens} here", param="max_tokens")
    if top is not None and top > limits.max_top_logprobs:
        raise Refused(400, f"top_logprobs: at most {limits.max_top_logprobs} here", param="top_logprobs")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4:
        raise Refused(400, "stop: at most 4 sequences", param="stop")
    if (longest := max(map(len, stop), default=0)) > limits.max_stop_chars:
        raise Refused(
            400,
            f"stop: each sequence at most {limits.max_stop_chars} characters here (one has {longest})",
            param="stop",
        )
    if chars > max_context * limits.chars_per_token:
        raise Refused(
            400,
            f"the prompt is {chars} characters, more than this model's context of "
            f"{max_context} tokens can hold",
            code="context_length_exceeded",
        )
    return stop


def usage(jobs: list[Job]) -> dict[str, int]:
    """A request's token counts (its choices share one prompt)."""
    prompt, done = len(jobs[0].prompt), sum(j.completion_tokens for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


class TokenText:
    """Tokens as OpenAI's chat API lists their log-probs; each token's text and bytes cached (per server)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=4096)(self._text)

    def _text(self, token: int) -> tuple[str, bytes]:
        """A token's text and its own bytes (a byte token's one byte, not its text's U+FFFD)."""
        return self.tokenizer.decode([token], skip_special_tokens=False), token_bytes(self.tokenizer, token)

    def logprob(self, token: int, logprob: float) -> dict:
        text, raw = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def entry(self, entry: TokenLogprob) -> dict:
        """A sampled token's log-prob and its alternatives'."""
        one = self.logprob
        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


@dataclass(slots=True)
class ChatReply:
    """One chat completion request's answer: whole (`whole`) or as stream chunks (`chunk`)."""

    model: str
    entry: Callable[[TokenLogprob], dict] | None
    """A token's log-probs as OpenAI's chat API lists them; None: the request asked for no log-probs."""
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        return {"content": [self.entry(e) for e in entries]} if self.entry else None

    def whole(self, jobs: list[Job]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": j.text},
                    "finish_reason": j.finish_reason,
                    "logprobs": self.logprobs(j.token_logprobs),
                }
                for i, j in enumerate(jobs)
            ],
            "usage": usage(jobs),
        }

    def chunk(self, i: int, text: str | None, entries: list[TokenLogprob], finish: str | None) -> dict:
        # The opening chunk ("", nothing else) names the role; the closing one (None) has no content.
        opening = text == "" and not entries and finish is None
        delta = {} if text is None else {"role": "assistant", "content": ""} if opening else {"content": text}
        choice = {
            "index": i,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": self.logprobs(entries) if entries else None,
        }
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }


@dataclass(slots=True)
class CompletionReply:
    """One (text) completion request's answer: whole (`whole`) or as stream chunks (`chunk`)."""

    model: str
    tokenizer: Any
    logprobs_asked: bool
    token_ids: bool
    """vLLM's `return_token_ids`: the prompt's and each choice's ids beside the text."""
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.logprobs_asked:
            return None
        decode = self.tokenizer.decode
        tokens = [decode([e.token], skip_special_tokens=False) for e in entries]
        offsets = [sum(map(len, tokens[:k])) for k in range(len(tokens))]
        tops = [{decode([t], skip_special_tokens=False): lp for t, lp in e.top} for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def whole(self, jobs: list[Job]) -> dict:
        ids = {"prompt_token_ids": jobs[0].prompt} if self.token_ids else {}
        choices = [
            {
                "index": i,
                "text": j.text,
                "finish_reason": j.finish_reason,
                "logprobs": self.logprobs(j.token_logprobs),
                **({"token_ids": j.ids} if self.token_ids else {}),
            }
            for i, j in enumerate(jobs)
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            **ids,
            "choices": choices,
            "usage": usage(jobs),
        }

    def chunk(self, i: int, text: str | None, entries: list[TokenLogprob], finish: str | None) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "text": text or "",
                    "finish_reason": finish,
                    "logprobs": self.logprobs(entries) if entries else None,
                }
            ],
        }
