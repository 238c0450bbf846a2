"""An engine over an OpenAI-compatible HTTP server: `tempering serve`, vLLM, or any server of that API.

The episode driver renders contexts to token ids with the model's own tokenizer and chat format, as for a
local engine; this engine sends each context as a token prompt to `{url}/completions` (`prompt` as a list
of ids, which OpenAI's and vLLM's completions API take) with `return_token_ids` (vLLM's and `tempering
serve`'s extension), and reads back the sampled token ids - so an episode over HTTP is the same token
sequence as one in process. A server that returns no ids gets its text encoded again with the tokenizer.
Several requests are in flight at once; a busy (429) or restarting (502-504) server, or a connection
that failed, is retried with backoff (`http.RetryingClient`). The server's own sampling is used: this engine cannot recompute
log-probs or load weights (it serves evaluation and the repair agent, not training).

The key is `api_key`, else $TEMPERING_API_KEY, else $OPENAI_API_KEY; it travels over https, or over plain
http to a loopback address only, unless `insecure_http`. The endpoint is asked for its models on
creation, so a server that is down fails there, before any work.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import torch
from torch import Tensor

from tempering.errors import TemperingError
from tempering.http import RetryingClient, Unreachable, is_loopback
from tempering.inference.chat import stop_token_ids
from tempering.inference.generation import Generation, generation_of

API_KEY_ENVS = ("TEMPERING_API_KEY", "OPENAI_API_KEY")


def is_url(spec: str) -> bool:
    return str(spec).startswith(("http://", "https://"))


class HTTPEngine:
    version = 0

    def __init__(
        self,
        url: str,
        tokenizer,
        sampling,
        *,
        model: str | None = None,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 300.0,
        insecure_http: bool = False,
        retries: int = 4,
        backoff_s: float = 0.5,
    ):
        self.url, self.tokenizer, self.sampling, self.concurrency = (
            url.rstrip("/"),
            tokenizer,
            sampling,
            concurrency,
        )
        source = (
            "the api_key given"
            if api_key
            else next((f"${k}" for k in API_KEY_ENVS if os.environ.get(k)), None)
        )
        key = api_key or next((os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), None)
        parts = urlsplit(self.url)
        if key and parts.scheme == "http" and not is_loopback(parts.hostname or "") and not insecure_http:
            raise TemperingError(
                f"refusing to send the API key ({source}) in plain text to {parts.hostname}: use an "
                "https URL, a loopback address, or --allow-insecure-http"
            )
        self.http = RetryingClient(
            self.url,
            token=key,
            timeout_s=timeout_s,
            connect_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
        )
        listed = self._answer(
            "GET", "/models", "GET /models", retries=0
        )  # a server that is down: now, at once
        if listed.status_code == 401:
            raise TemperingError(
                f"model server at {self.url} refused the API key (401); set $TEMPERING_API_KEY"
            )
        if listed.status_code != 200:
            raise TemperingError(f"model server at {self.url}: GET /models answered {listed.status_code}")
        served = listed.json().get("data", [])
        ids = [m.get("id") for m in served]
        if model is not None and ids and model not in ids:
            raise TemperingError(
                f"model server at {self.url} has no model '{model}'; it serves {', '.join(ids)}"
            )
        self.name = model or (ids[0] if ids else "default")
        self.max_context = next((m.get("max_model_len") for m in served if m.get("id") == self.name), None)
        self.stop_ids = stop_token_ids(tokenizer)

    def _answer(self, method: str, path: str, what: str, **kw):
        """The server's answer (busy or restarting ones retried: `http.RetryingClient`), or one line saying
        why none came."""
        try:
            return self.http.request(method, path, **kw)
        except Unreachable as e:
            raise TemperingError(f"model server at {self.url} is unreachable: {what}: {e}") from None

    def _one(self, context: list[int], max_tokens: int, greedy: bool, seed: int) -> tuple[list[int], str]:
        s = self.sampling
        body = {
            "model": self.name,
            "prompt": context,
            "max_tokens": max_tokens,
            "temperature": 0.0 if greedy else s.temperature,
            "top_p": s.top_p,
            "seed": seed,
            "return_token_ids": True,
        }
        r = self._answer("POST", "/completions", "completions", json=body)
        if r.status_code != 200:
            raise TemperingError(
                f"model server at {self.url}: completions answered {r.status_code}: {r.text[:200]}"
            )
        choice = r.json()["choices"][0]
        reason = choice.get("finish_reason") or "length"
        ids = choice.get("token_ids")
        if ids is None:  # a server without the extension: the text, encoded again
            ids = self.tokenizer(choice.get("text") or "", add_special_tokens=False).input_ids
            if reason == "stop":
                ids.append(self.stop_ids[0])
        return list(ids), reason

    def generate(
        self,
        contexts: list[list[int]],
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        keep: bool = False,
    ) -> Generation:
        seeds = torch.randint(0, 1 << 31, (len(contexts),), generator=generator).tolist()
        budget = max_new_tokens or self.sampling.max_new_tokens
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(contexts)))) as pool:
            done = list(pool.map(lambda a: self._one(a[0], budget, greedy, a[1]), zip(contexts, seeds)))
        return generation_of(
            self.tokenizer, contexts, [ids for ids, _ in done], None, set(self.stop_ids), self.version
        )

    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_attention: Tensor
    ) -> Tensor:
        raise TemperingError("an HTTP engine cannot recompute log-probs (it serves evaluation and the agent)")

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        raise TemperingError("an HTTP engine's weights are the server's")

    def release(self) -> None:
        pass
