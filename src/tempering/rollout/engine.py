"""The rollout-engine seam: what samples trajectories, under which distribution, with which weights.

An engine owns the sampling distribution - temperature, top-p, the token budget - so that the sampler,
the reference pass and the update cannot disagree about it (PPO's ratio is only right when the trainer
recomputes log-probs under the distribution that sampled). It offers three calls:

    generate(contexts)               -> Generation: ids, log-probs, finish reasons, the policy version
    logprobs(prompt, response, ...)  -> log-probs of given responses under the same distribution
    load_weights(state, version)     -> the trainer's new weights; later samples record `version`

Nothing here assumes the engine shares the trainer's process or memory: the trainer only hands it a
state dict and a version number, and reads back token ids and log-probs (CPU tensors). `LocalEngine`
is the in-process transformers implementation (where `load_weights` of the trainer's own parameters
costs nothing); a Ray actor, a vLLM engine or an OpenAI-compatible HTTP client implement the same
protocol. An engine that keeps each episode's KV cache across turns would take the episode ids as
contexts just the same: the driver passes whole contexts and never re-tokenizes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tempering.models.forward import response_logprobs
from tempering.rollout.chat import stop_token_ids
from tempering.rollout.generate import Generation, RowSampling, TokenStep, generate


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature of sampling - and of every log-prob the trainer computes for these samples."""
    top_p: float = 1.0
    """Nucleus sampling; recorded log-probs are under the full tempered distribution (as verl does)."""
    max_new_tokens: int = 48
    """Most tokens one generation (one turn) may write."""


class Engine(Protocol):
    tokenizer: object
    sampling: SamplingParams
    version: int
    stop_ids: tuple[int, ...]
    """Ids that end a generation (EOS, the chat template's end of turn); an action ends with one of them."""

    def generate(self, contexts: list[list[int]], *, generator: torch.Generator | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None) -> Generation: ...

    def logprobs(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                 response_attention: Tensor) -> Tensor: ...

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None: ...


class LocalEngine:
    """Samples with a transformers model in this process (KV cache, shared prompt prefill).
    `adapters=False` serves a peft model's base with its LoRA adapters disabled (a LoRA run's reference)."""

    def __init__(self, model, tokenizer, sampling: SamplingParams = SamplingParams(), version: int = 0,
                 adapters: bool = True):
        self.model, self.tokenizer, self.sampling, self.version = model, tokenizer, sampling, version
        self.stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self._weights = nullcontext if adapters else model.disable_adapter

    def generate(self, contexts: list[list[int]], *, generator: torch.Generator | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                 rows: RowSampling | None = None,
                 on_step: Callable[[TokenStep], Collection[int] | None] | None = None) -> Generation:
        """One completion per context (repeat a context G times for a group); greedy ignores the sampling
        distribution (evaluation). A server gives each row its own sampling settings (`rows`) and hears the
        tokens as they come, ending rows early (`on_step`, see `generate`)."""
        s = sampling or self.sampling
        with self._weights():
            gen = generate(self.model, self.tokenizer, contexts, max_new_tokens=max_new_tokens or s.max_new_tokens,
                           temperature=s.temperature, top_p=s.top_p, greedy=greedy, generator=generator,
                           stop_ids=self.stop_ids, rows=rows, on_step=on_step)
        gen.version = self.version
        return gen

    @torch.no_grad()
    def logprobs(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                 response_attention: Tensor) -> Tensor:
        """log pi(response_t | ...) under the sampling temperature, on the CPU. (B, R)"""
        with self._weights():
            logprobs, _ = response_logprobs(self.model, prompt_ids, prompt_mask, response_ids, response_attention,
                                            temperature=self.sampling.temperature)
        return logprobs.cpu()

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Copy `state` into the model, unless it is the model's own storage (the trainer's policy in this
        process: then there is nothing to copy)."""
        own = self.model.state_dict()
        if any(own[k].data_ptr() != v.data_ptr() for k, v in state.items()):
            self.model.load_state_dict(state)
        self.version = version
