"""What an engine is, in two parts, and the types its requests travel in.

    BatchEngine      what training and evaluation use: `generate` (one completion per context, under the
                     engine's `SamplingParams`), `logprobs` (of given responses under the same distribution),
                     `load_weights` (the trainer's new weights and their version), `release`
    RequestEngine    what a server uses: `submit` one `Request` (its own sampling settings, seed, streaming
                     callback) -> a `Handle` (its `Completion`, cancellable); `start` a loop that runs
                     requests as they arrive (continuous batching), `close` it

`LocalEngine` (`engine.py`) is both; `HTTPEngine` and `VLLMEngine` are batch engines. `tempering serve`
accepts any request engine. (The scheduler that runs requests is `scheduler.py`.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tempering.inference.generation import Generation
from tempering.inference.sampling import Sampled


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature of sampling - and of every log-prob the trainer computes for these samples."""
    top_p: float = 1.0
    """Nucleus sampling; recorded log-probs are under the full tempered distribution (as verl does)."""
    max_new_tokens: int = 48
    """Most tokens one generation (one turn) may write."""


@dataclass
class Request:
    prompt: list[int]
    """The whole context, token ids (a multi-turn episode's prompt, actions and observations so far)."""
    max_tokens: int
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    seed: int = 0
    """The row's own random stream (`sampling.Uniforms`)."""
    top_logprobs: int = 0
    keep: bool = False
    """Keep the sequence's cache when it is done: a next request that extends it computes only its new tokens."""
    on_token: Callable[[int, Sampled, int], bool] | None = None
    """Streaming: hears (token, the step's `Sampled`, the row's index in it) for each token; True ends the row
    now (finish reason `stop`)."""
    client: str = ""
    """Who asked (a server's client: an address, or a recording session)."""


@dataclass
class Completion:
    prompt: list[int]
    ids: list[int]
    """The sampled tokens, the stop token included when one ended the row."""
    logprobs: list[float]
    """Of each sampled token under the row's sampling distribution."""
    finish_reason: str
    """`stop` (a stop token, or the request's own stop), `length` (max_tokens), `cancelled`."""
    version: int
    """The policy version that sampled it."""
    reused: int = 0
    """Prompt tokens whose cache came from a kept sequence (not computed again)."""


class Handle:
    """A submitted request: its result (a `Completion`) and how to cancel it."""

    def __init__(self, request: Request):
        self.request = request
        self.future: Future = Future()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        """The row leaves its batch at the next step (or never runs, if it is still waiting)."""
        self.cancelled.set()

    def result(self, timeout: float | None = None) -> Completion:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


class BatchEngine(Protocol):
    tokenizer: object
    sampling: SamplingParams
    version: int
    stop_ids: tuple[int, ...]
    """Ids that end a generation (EOS, the chat template's end of turn); an action ends with one of them."""

    def generate(
        self,
        contexts: list[list[int]],
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        keep: bool = False,
    ) -> Generation: ...

    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_attention: Tensor
    ) -> Tensor: ...

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None: ...

    def release(self) -> None:
        """Drop what is kept for next turns and free the cache's memory (the episodes are done)."""


class RequestEngine(Protocol):
    tokenizer: object
    stop_ids: tuple[int, ...]

    def submit(self, request: Request) -> Handle:
        """Queue one request; it joins the running rows at the next step of the loop."""

    def start(self) -> None:
        """Run requests as they arrive, on a loop of the engine's own (a server)."""

    def close(self) -> None:
        """Stop the loop and wait for it to end."""
