"""The OpenAI request bodies `tempering serve` accepts (pydantic models), and which of OpenAI's fields it
implements, ignores as harmless, or refuses (`unsupported`). The server (`server.py`) does the rest."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    model_config = ConfigDict(extra="allow")  # checked by `unsupported`: accepted only when harmless

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """`null` for a field means its default, as at OpenAI (`"temperature": null` samples at 1, `"n": null`
        is one choice); a required field stays required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(union_mode="left_to_right")
    """Text, or token ids (OpenAI's and vLLM's completions API take both)."""
    logprobs: int | None = Field(None, ge=0, le=5)
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
