"""vLLM behind the engine protocol (`rollout.engine: vllm`, the `tempering[vllm]` extra; `make vllm` builds
a venv with the CPU build here).

Same calls as `LocalEngine`: `generate(contexts)` sends each context as a token prompt with its own seed
(drawn from the caller's generator) and reads back the sampled ids and their log-probs - under the
sampling distribution (`logprobs_mode="processed_logprobs"`: after the temperature; with top-p 1, the
distribution the trainer recomputes); `logprobs(...)` scores given responses as prompt log-probs;
`load_weights(state, version)` pushes the trainer's weights into the running engine through vLLM's
in-place reload (a LoRA policy's adapters merged into their base first: vLLM serves plain weights), and
later samples record `version`.
vLLM manages its own KV cache, batching and prefix caching; `keep` and `release` have nothing to do.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so pushing weights copies tensors, not
pickles. A model object (the trainer's policy) is saved once to a temporary directory for vLLM to load.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from tempering.checkpoint import rng_state, set_rng_state
from tempering.errors import TemperingError
from tempering.inference.chat import stop_token_ids
from tempering.inference.generation import Generation, generation_of


def plain_state(state: Mapping[str, Tensor], scaling: float | None = None) -> Iterator[tuple[str, Tensor]]:
    """A (peft) state dict as the base model's own names, each LoRA pair merged into its weight:
    W + scaling * B @ A. A plain state dict passes through."""
    for name, value in state.items():
        if "lora_" in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        stem = name.removesuffix(".base_layer.weight")
        a, b = state.get(f"{stem}.lora_A.default.weight"), state.get(f"{stem}.lora_B.default.weight")
        if a is not None and b is not None and name.endswith(".base_layer.weight"):
            value = value + (scaling or 1.0) * (b.float() @ a.float()).to(value.dtype)
        yield plain, value


@contextlib.contextmanager
def _callers_random_state():
    """vLLM seeds Python's, NumPy's and torch's global generators when it starts (its `seed`); the caller's
    draws that use them - LoRA dropout in the update, a resumed run's restored state - go on as before (the
    states a checkpoint keeps)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


class VLLMEngine:
    def __init__(
        self,
        source,
        tokenizer,
        sampling,
        *,
        version: int = 0,
        lora_scaling: float | None = None,
        max_model_len: int | None = None,
        **options,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError:
            raise TemperingError(
                "rollout.engine: vllm needs the vllm package (pip install 'tempering[vllm]'; CPU: make vllm)"
            ) from None
        self.tokenizer, self.sampling, self.version = tokenizer, sampling, version
        self.lora_scaling = lora_scaling
        self._saved = None
        if not isinstance(source, str | Path):  # a model object: vLLM loads from a directory
            self._saved = tempfile.TemporaryDirectory(prefix="tempering-vllm-")
            base = source.get_base_model() if hasattr(source, "get_base_model") else source
            base.save_pretrained(
                self._saved.name, state_dict=dict(plain_state(source.state_dict(), lora_scaling))
            )
            tokenizer.save_pretrained(self._saved.name)
            source = self._saved.name
        self.stop_ids = stop_token_ids(
            tokenizer, source
        )  # the directory vLLM loads: its generation_config.json
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with _callers_random_state():
            self.llm = LLM(
                model=str(source),
                dtype="float32" if device == "cpu" else "auto",
                seed=0,
                **({"max_model_len": max_model_len} if max_model_len else {}),  # None: the model's own
                logprobs_mode="processed_logprobs",
                gpu_memory_utilization=options.pop("gpu_memory_utilization", 0.2 if device == "cpu" else 0.5),
                **options,
            )

    def _params(self, greedy: bool, max_tokens: int, seed: int, **extra):
        from vllm import SamplingParams as VLLMParams

        s = self.sampling
        return VLLMParams(
            temperature=0.0 if greedy else s.temperature,
            top_p=s.top_p,
            max_tokens=max_tokens,
            seed=seed,
            stop_token_ids=list(self.stop_ids),
            logprobs=0,
            detokenize=False,
            **extra,
        )

    def generate(
        self,
        contexts: list[list[int]],
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        keep: bool = False,
    ) -> Generation:
        from vllm import TokensPrompt

        seeds = torch.randint(0, 1 << 62, (len(contexts),), generator=generator).tolist()
        budget = max_new_tokens or self.sampling.max_new_tokens
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(c)) for c in contexts],
            [self._params(greedy, budget, seed) for seed in seeds],
            use_tqdm=False,
        )
        responses, logprobs = [], []
        for out in outputs:
            done = out.outputs[0]
            ids = list(done.token_ids)
            entries = done.logprobs or [{}] * len(
                ids
            )  # per position: {token id: Logprob}, the sampled one in it
            lp = [entry[token].logprob if token in entry else 0.0 for token, entry in zip(ids, entries)]
            if done.finish_reason == "stop" and (not ids or ids[-1] not in self.stop_ids):
                ids.append(self.stop_ids[0])  # the stop token, when vLLM leaves it out
                lp.append(0.0)
            responses.append(ids)
            logprobs.append(lp)
        return generation_of(self.tokenizer, contexts, responses, logprobs, set(self.stop_ids), self.version)

    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_attention: Tensor
    ) -> Tensor:
        """Of each response token under the sampling distribution, as prompt log-probs of prompt + response."""
        from vllm import TokensPrompt

        rows = []
        for p, pm, r, ra in zip(prompt_ids, prompt_mask, response_ids, response_attention):
            prompt, response = p[pm.bool()].tolist(), r[: int(ra.sum())].tolist()
            rows.append((prompt, response))
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p + r) for p, r in rows],
            self._params(True, 1, 0, prompt_logprobs=0),
            use_tqdm=False,
        )
        out = torch.zeros(response_ids.shape)
        for i, ((prompt, response), o) in enumerate(zip(rows, outputs)):
            for k, token in enumerate(response):
                entry = o.prompt_logprobs[len(prompt) + k]
                out[i, k] = entry[token].logprob
        return out

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        weights = list(plain_state(state, self.lora_scaling))
        # vLLM's in-place reload, not the model's own `load_weights`: after loading, a platform may repack a
        # layer's weights into its kernel's layout (the CPU build's oneDNN linears drop the loader they came
        # in with); the reload restores the checkpoint layout, loads, and packs them again.
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()
        self.version = version

    def release(self) -> None:
        pass
