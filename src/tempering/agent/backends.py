"""Where the agent's (and the server's) completions come from: a local model, or an OpenAI-compatible endpoint.

    backend.chat(conversations, max_tokens=..., temperature=...) -> [Completion, ...]

`LocalChat` renders each conversation with the chat format the model was trained with (`rollout.chat`:
its tokenizer's template, or the plain format of the tiny model - for which a conversation is exactly an
episode's token sequence: prompt, action, feedback, action, ...), and samples them in one batch with a
`LocalEngine`. `HTTPChat` posts each conversation to `{url}/chat/completions` (a `tempering serve`, vLLM,
or any OpenAI-compatible service), several at a time. Temperature 0 is greedy decoding on both.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from tempering.errors import TemperingError

Messages = list[dict[str, str]]
API_KEY_ENVS = ("TEMPERING_API_KEY", "OPENAI_API_KEY")


@dataclass
class Completion:
    text: str
    finish_reason: str
    """`stop` (the model ended its turn), `length` (max_tokens reached) or `context` (no room left in the
    model's context: nothing was generated)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatBackend(Protocol):
    name: str

    def chat(self, conversations: list[Messages], *, max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> list[Completion]: ...


class LocalChat:
    """A transformers model in this process. `max_context` bounds prompt + completion (default: the
    model's position limit)."""

    def __init__(self, model, tokenizer, *, name: str = "local", chat: str = "auto", max_context: int | None = None):
        from tempering.rollout.chat import chat_format
        from tempering.rollout.engine import LocalEngine

        self.name, self.engine, self.tokenizer = name, LocalEngine(model, tokenizer), tokenizer
        self.format = chat_format(tokenizer, chat)
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.max_context = min(max_context or limit, limit)

    def render(self, messages: Messages) -> list[int]:
        """Prompt ids of a conversation; ValueError when its roles do not fit the chat format."""
        return self.format.render(messages)

    def generate(self, prompts: list[list[int]], *, max_tokens: list[int], temperature: float, top_p: float = 1.0,
                 seed: int = 0) -> list[Completion]:
        """Complete token prompts in one batch (each up to its own `max_tokens`, within the context)."""
        from tempering.rollout.engine import SamplingParams

        rooms = [min(m, self.max_context - len(p)) for p, m in zip(prompts, max_tokens)]
        rows = [i for i, room in enumerate(rooms) if room > 0]
        out = [Completion("", "context", len(p), 0) for p in prompts]
        if not rows:
            return out
        greedy = temperature <= 0
        gen = self.engine.generate([prompts[i] for i in rows], generator=torch.Generator().manual_seed(seed),
                                   greedy=greedy, max_new_tokens=max(rooms[i] for i in rows),
                                   sampling=SamplingParams(1.0 if greedy else temperature, top_p))
        stops = set(self.engine.stop_ids)
        for row, i in enumerate(rows):
            ids = gen.response_ids[row, : int(gen.response_mask[row].sum())].tolist()[: rooms[i]]
            ended = bool(ids) and ids[-1] in stops
            text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            out[i] = Completion(text, "stop" if ended else "length", len(prompts[i]), len(ids))
        return out

    def chat(self, conversations: list[Messages], *, max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> list[Completion]:
        prompts = [self.render(m) for m in conversations]
        return self.generate(prompts, max_tokens=[max_tokens] * len(prompts), temperature=temperature,
                             top_p=top_p, seed=seed)


class HTTPChat:
    """An OpenAI-compatible chat-completions endpoint. `url` is the API base (`http://host:port/v1`); the
    key is `api_key`, else $TEMPERING_API_KEY, else $OPENAI_API_KEY (none for a loopback `tempering serve`).
    A key travels over https, or over plain http to a loopback address; plain http to any other host is
    refused while a key would be sent, unless `insecure_http` (anyone on the path could read the key).
    The endpoint is asked for its models on creation, so a server that is down fails here, before any work."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None, concurrency: int = 8,
                 timeout_s: float = 300.0, insecure_http: bool = False):
        from urllib.parse import urlsplit

        import httpx

        from tempering.sandbox.service import is_loopback

        self.url = url.rstrip("/")
        source = "the api_key given" if api_key else next((f"${k}" for k in API_KEY_ENVS if os.environ.get(k)), None)
        key = api_key or next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), None)
        parts = urlsplit(self.url)
        if key and parts.scheme == "http" and not is_loopback(parts.hostname or "") and not insecure_http:
            raise TemperingError(f"refusing to send the API key ({source}) in plain text to {parts.hostname}: use an "
                                 "https URL, a loopback address, or --allow-insecure-http")
        self.client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"} if key else {})
        self.concurrency = concurrency
        try:
            listed = self.client.get(f"{self.url}/models")
        except httpx.HTTPError as e:
            raise TemperingError(f"model server at {self.url} is unreachable: {e}") from None
        if listed.status_code == 401:
            raise TemperingError(f"model server at {self.url} refused the API key (401); set $TEMPERING_API_KEY")
        if listed.status_code != 200:
            raise TemperingError(f"model server at {self.url}: GET /models answered {listed.status_code}")
        ids = [m.get("id") for m in listed.json().get("data", [])]
        if model is not None and ids and model not in ids:
            raise TemperingError(f"model server at {self.url} has no model '{model}'; it serves {', '.join(ids)}")
        self.name = model or (ids[0] if ids else "default")

    def _one(self, messages: Messages, max_tokens: int, temperature: float, top_p: float, seed: int) -> Completion:
        import httpx

        body = {"model": self.name, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed}
        try:
            r = self.client.post(f"{self.url}/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise TemperingError(f"model server at {self.url}: {e}") from None
        if r.status_code == 400 and "context" in r.text:  # OpenAI's context_length_exceeded, vLLM's wording
            return Completion("", "context")
        if r.status_code != 200:
            raise TemperingError(f"model server at {self.url}: chat/completions answered {r.status_code}: "
                                 f"{r.text[:200]}")
        data = r.json()
        choice, usage = data["choices"][0], data.get("usage") or {}
        return Completion(choice["message"].get("content") or "", choice.get("finish_reason") or "stop",
                          usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    def chat(self, conversations: list[Messages], *, max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0) -> list[Completion]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(conversations)))) as pool:
            return list(pool.map(lambda m: self._one(m, max_tokens, temperature, top_p, seed), conversations))


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def load_local(spec: str | Path, *, device: str = "auto", chat: str = "auto",
               max_context: int | None = None) -> LocalChat:
    """A local backend from anything `checkpoint.resolve_model` takes: a model directory, a checkpoint or
    run directory (its newest model), or a registry name (`smollm2-135m-instruct`, prepared on first use)."""
    from tempering.checkpoint import resolve_model
    from tempering.models.loading import load_model, load_tokenizer, resolve_device

    model_dir = resolve_model(spec)
    model = load_model(model_dir, device=resolve_device(device, "--device"))
    return LocalChat(model, load_tokenizer(model_dir), name=str(spec), chat=chat, max_context=max_context)
