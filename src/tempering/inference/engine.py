"""The rollout-engine seam: what samples trajectories, under which distribution, with which weights.

An engine owns the sampling distribution - temperature, top-p, the token budget - so that the sampler,
the reference pass and the update cannot disagree about it (PPO's ratio is only right when the trainer
recomputes log-probs under the distribution that sampled). Underneath it is request-level:

    submit(Request) -> Handle        one sequence with its own sampling settings and seed; streamed
                                     token by token (`Request.on_token`), cancellable, its `Completion`
                                     (ids, log-probs, finish reason, the policy version) at the end
    generate(contexts)               -> Generation: submit one request per context and wait (RL
                                     rollouts, evaluation, the repair agent)
    logprobs(prompt, response, ...)  -> log-probs of given responses under the same distribution
    load_weights(state, version)     -> the trainer's new weights; later samples record `version`

`LocalEngine` runs a transformers model in this process over a KV cache it manages, with continuous
batching (`scheduler.py`: requests join at the next decode step, finished or cancelled rows leave at
once, a group's shared prompt and an episode's earlier turns are computed once). A server starts its loop
in a thread of its own (`start`); `generate` without one drives the loop in the caller's thread, which
keeps a training run's schedule - and so its samples - fixed. Nothing here assumes the engine shares the
trainer's process or memory: the trainer only hands it a state dict and a version number, and reads back
token ids and log-probs (CPU tensors); a Ray actor, a vLLM engine or an OpenAI-compatible HTTP client
implement the same protocol (its batch and request parts, and the request types: `protocol.py`).
`make_engine` is the one way to build one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import TypeGuard

import torch
from torch import Tensor

from tempering.inference.chat import stop_token_ids
from tempering.inference.decoder import FAMILY
from tempering.inference.generation import Generation, generation_of
from tempering.inference.protocol import BatchEngine, Completion, Handle, Request, SamplingParams
from tempering.inference.scheduler import Scheduler
from tempering.models.forward import response_logprobs
from tempering.models.lora import is_peft, merged_copy

Engine = BatchEngine
"""The engine as the episode driver, evaluation and the repair agent use it (`protocol.BatchEngine`)."""
DEFAULT_SAMPLING = SamplingParams()


class LocalEngine:
    """Samples with a transformers model in this process (see the module docstring). `adapters=False`
    serves a peft model's base with its LoRA adapters disabled (a LoRA run's reference). `max_rows` bounds
    the rows decoded together (more requests wait for a free slot); `on_step` hears each decode step's
    number of rows (a server's batch-size metric)."""

    def __init__(
        self,
        model,
        tokenizer,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        version: int = 0,
        adapters: bool = True,
        max_rows: int = 256,
        max_length: int | None = None,
        dtype: torch.dtype | None = None,
        on_step: Callable[[int], None] | None = None,
    ):
        self.model, self.tokenizer, self.sampling, self.version = model, tokenizer, sampling, version
        self.stop_ids = stop_token_ids(tokenizer, model)
        self._weights = nullcontext if adapters else model.disable_adapter
        self._merge = adapters and is_peft(model)
        # float32 = no mixed precision (`models.loading.compute_dtype`): the model samples in its own dtype
        self._dtype = dtype if dtype not in (None, torch.float32, next(model.parameters()).dtype) else None
        assert adapters or self._dtype is None, "a reference engine samples nothing: it needs no bf16 copy"
        self.scheduler = Scheduler(
            model,
            self.stop_ids,
            max_rows=max_rows,
            max_length=max_length,
            version=lambda: self.version,
            on_step=on_step,
        )
        self._copy: torch.nn.Module | None = None
        self._loop: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False

    # ------------------------------------------------------------------------------ request level

    def submit(self, request: Request) -> Handle:
        handle = self.scheduler.submit(request)
        self._wake.set()
        return handle

    def start(self) -> None:
        """Run the scheduler's loop in a background thread (a server); `generate` then waits on it."""
        if self._loop is None:
            self._loop = threading.Thread(target=self._serve, name="engine", daemon=True)
            self._loop.start()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._loop is not None:
            self._loop.join(timeout=30)
            self._loop = None

    def _serve(self) -> None:
        while not self._closed:
            if not self.scheduler.busy:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self._step()

    def _step(self) -> None:
        if (self._merge or self._dtype) and self._copy is None:
            # A LoRA policy samples from a merged copy (W + s B A): every projection one matmul, not three
            # (measured: a third of a SmolLM2 decode step went to the adapters' own small matmuls); with
            # `dtype` (mixed precision) the copy is cast, e.g. bf16: half the weight bytes a decode step
            # streams. Made again after new weights; freed by `release` (the update then has the memory).
            sampler = merged_copy(self.model, self._dtype)  # no transient fp32 copy: 0.6 -> 0.2 s for SmolLM2
            self._copy = (prepacked(sampler) if self._dtype else sampler).eval()
            self.scheduler.use(self._copy)
        try:
            with self._weights():
                self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - every request in flight hears it; the engine stays up
            self.scheduler.fail(e)

    def run(self, handles: list[Handle]) -> list[Completion]:
        """Wait for `handles`: on the background loop if one runs, else by stepping in this thread."""
        if self._loop is None:
            with self.scheduler.engine_mode():
                while not all(h.done() for h in handles):
                    self._step()
        return [h.result() for h in handles]

    # --------------------------------------------------------------------------------- batch level

    def generate(
        self,
        contexts: list[list[int]],
        *,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        keep: bool = False,
    ) -> Generation:
        """One completion per context (repeat a context G times for a group); greedy ignores the sampling
        distribution (evaluation). Each row's random numbers come from a seed drawn from `generator`.
        `keep`: the rows' caches are kept when they are done, for a next turn that extends them."""
        s = self.sampling
        seeds = torch.randint(0, 1 << 62, (len(contexts),), generator=generator).tolist()
        budget = max_new_tokens or s.max_new_tokens
        handles = [
            self.submit(Request(list(c), budget, 0.0 if greedy else s.temperature, s.top_p, seed, keep=keep))
            for c, seed in zip(contexts, seeds)
        ]
        return self._generation(contexts, self.run(handles))

    def _generation(self, contexts: list[list[int]], done: list[Completion]) -> Generation:
        return generation_of(
            self.tokenizer,
            contexts,
            [c.ids for c in done],
            [c.logprobs for c in done],
            set(self.stop_ids),
            self.version,
            [c.reused for c in done],
        )

    @torch.no_grad()
    def logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_attention: Tensor
    ) -> Tensor:
        """log pi(response_t | ...) under the sampling temperature, on the CPU. (B, R)"""
        with self._weights():
            logprobs, _ = response_logprobs(
                self.model,
                prompt_ids,
                prompt_mask,
                response_ids,
                response_attention,
                temperature=self.sampling.temperature,
            )
        return logprobs.cpu()

    def release(self) -> None:
        """Drop the kept sequences and free the cache's buffers - unless a server's loop is using them."""
        if self._loop is None:
            self.scheduler.forget()
            if not self.scheduler.busy:
                self.scheduler.cache.clear()
                self._drop_copy()

    def load_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Copy `state` into the model, unless it is the model's own storage (the trainer's policy in this
        process: then there is nothing to copy). Kept caches were computed by the old weights: dropped."""
        own = self.model.state_dict()
        if any(own[k].data_ptr() != v.data_ptr() for k, v in state.items()):
            self.model.load_state_dict(state)
        self.version = version
        self.scheduler.forget()
        self._drop_copy()

    def _drop_copy(self) -> None:
        if self._copy is not None and not self.scheduler.busy:
            self._copy = None
            self.scheduler.use(self.model)


def prepacked(model):
    """`model` (a bf16 sampling copy) with each CPU linear layer's weight packed once for oneDNN's matmul (AMX
    tiles) - a plain bf16 linear reorders its weight on every call: measured 1.33x faster over SmolLM2's
    projections at 32 rows, bitwise the same outputs. A torch build without oneDNN keeps plain layers. For the
    engine's own forward (`inference.decoder`, the Llama family) projections that read the same input are also
    one packed layer (`fuse`): q, k and v as `qkv_proj`, the MLP's gate and up as `gate_up_proj`; the layers
    they were made of stay, unpacked, for the model's own forward."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return model
    fused: set[int] = set()
    if getattr(getattr(model, "config", None), "model_type", None) in FAMILY:
        for module in list(model.modules()):
            if not hasattr(module, "q_norm"):  # Qwen3 norms q and k per head before rotary: kept apart
                fused |= fuse(module, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
            fused |= fuse(module, ("gate_proj", "up_proj"), "gate_up_proj")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _packable(child) and id(child) not in fused:
                setattr(parent, name, _PackedLinear(child.weight.detach(), child.bias))
    return model


def fuse(module: torch.nn.Module, names: tuple[str, ...], fused: str) -> set[int]:
    """`module`'s linear layers `names`, which read the same input, also as one packed layer `fused` whose
    output is theirs side by side: one matmul over the stacked weights, the same outputs bitwise (measured: q,
    k, v in half the time of three, gate and up 10% faster than two, at a decode step's 32 rows). The ids of
    the layers fused (none where they are not all plain bf16 CPU linears alike in bias)."""
    layers = [layer for name in names if _packable(layer := getattr(module, name, None))]
    if len(layers) < len(names) or len({layer.bias is None for layer in layers}) > 1:
        return set()
    weight = torch.cat([layer.weight.detach() for layer in layers])
    bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
    setattr(module, fused, _PackedLinear(weight, bias))
    return {id(layer) for layer in layers}


def _packable(layer: object) -> TypeGuard[torch.nn.Linear]:
    return (
        type(layer) is torch.nn.Linear
        and layer.weight.dtype == torch.bfloat16
        and layer.weight.device.type == "cpu"
    )


class _PackedLinear(torch.nn.Module):
    def __init__(self, weight: Tensor, bias: Tensor | None, rows: int = 32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)  # rows: a size hint
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def as_function(self) -> Callable[[Tensor], Tensor]:
        """`forward` of a contiguous x without nn.Module's call machinery: a SmolLM2 decode step calls 120 of
        them (`inference.decoder`), whose module calls took 1.5 ms of a 50 ms step."""
        op, weight, bias = torch.ops.mkldnn._linear_pointwise.default, self.weight, self.bias
        return lambda x: op(x, weight, bias, "none", [], "")


ENGINES = ("local", "vllm", "http")


def open_model(
    model_dir: str | Path,
    sampling: SamplingParams = DEFAULT_SAMPLING,
    *,
    device: str = "auto",
    compute: str = "float32",
    dtype: str = "float32",
    keys: tuple[str, str] = ("run.device", "model.compute"),
    max_rows: int = 256,
    on_step: Callable[[int], None] | None = None,
) -> LocalEngine:
    """The one way a model directory becomes an engine (`eval`, `repair`, `serve`, the pipeline's
    evaluations): `device` resolved (`auto` = CUDA when present), the sampling precision `compute` chosen
    for it (`models.loading.compute_dtype`), both checked before the weights load (in `dtype`); `keys` name
    the two settings in those errors (`--device` and `--compute` on the command line)."""
    from tempering.models.loading import compute_dtype, load_model, load_tokenizer, resolve_device

    device = resolve_device(device, keys[0])
    precision = compute_dtype(compute, device, keys[1])
    model = load_model(model_dir, dtype=dtype, device=device)
    engine = make_engine(
        model, load_tokenizer(model_dir), sampling, dtype=precision, max_rows=max_rows, on_step=on_step
    )
    assert isinstance(engine, LocalEngine)  # (kind "local")
    return engine


def make_engine(
    source,
    tokenizer,
    sampling: SamplingParams = DEFAULT_SAMPLING,
    *,
    kind: str = "local",
    version: int = 0,
    adapters: bool = True,
    dtype: torch.dtype | None = None,
    **options,
) -> Engine:
    """The one way to build an engine. `kind`: `local` (`source` a transformers model in this process;
    `dtype` a lower precision to sample in - `models.loading.compute_dtype(cfg.model.compute, device)`;
    None or float32 = the model's own),
    `vllm` (vLLM over `source`, a model directory; the `tempering[vllm]` extra), `http` (`source` the URL of
    an OpenAI-compatible server). `options`: as the engine's class takes them (`LocalEngine`'s `max_rows`,
    `on_step`; `remote.HTTPEngine`'s, `vllm.VLLMEngine`'s)."""
    if kind == "local":
        return LocalEngine(
            source, tokenizer, sampling, version=version, adapters=adapters, dtype=dtype, **options
        )
    if kind == "http":
        from tempering.inference.remote import HTTPEngine

        return HTTPEngine(source, tokenizer, sampling, **options)
    if kind == "vllm":
        from tempering.inference.vllm import VLLMEngine

        return VLLMEngine(source, tokenizer, sampling, version=version, **options)
    raise ValueError(f"unknown engine '{kind}'; known: {', '.join(ENGINES)}")
