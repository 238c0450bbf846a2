"""The engine's scheduler: continuous batching of requests over the slot cache (`kvcache.py`).

Each `step()`:
1. admits waiting requests while slots are free: a request whose context extends a kept sequence (an
   episode's next turn) takes that sequence's slot and computes only its new tokens; requests with the same
   context (a group's G samples) are computed once and copied; the rest prefill from position 0, in chunks
   of `prefill_chunk` tokens, several rows at once;
2. runs one decode step for every running row (one token each, over the cache, in place);
3. samples each row's token with its own settings and random numbers (`sampling.py`), tells the request
   (streaming; it may end itself, e.g. on a stop string), and ends rows that are done - a stop token, its
   token budget, cancelled. An ended row leaves at once: the last running row moves into its slot, so the
   running rows stay contiguous and a new request joins at the next step.

Requests may arrive at any time (a server submits from other threads; `step` runs in the engine's loop).
Rows are admitted in submission order and every row's randomness is its own, so the same requests give
the same tokens whether they arrive together or one by one (up to the floats of differently shaped
batches).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor
from transformers import AttentionInterface

from tempering.inference.decoder import LlamaDecoder
from tempering.inference.kvcache import SlotCache
from tempering.inference.protocol import Completion, Handle, Request
from tempering.inference.sampling import Uniforms, sample

ATTENTION = "tempering_slots"


def slot_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention over the slot cache. A decode step (one query token) in fp32 batches the heads that share
    a key/value head together (no copy of the keys per query head, unlike `repeat_kv`; faster than SDPA's
    CPU kernel there: measured 19 vs 26 ms of a 32-row SmolLM2 decode step); a prefill chunk, and a bf16
    decode step (SDPA 17 ms, the batched matmuls 32: they copy the keys), use SDPA - the Llama family's own
    forward (`decoder.py`) takes its bf16 decode steps to the kernel of `kernels/` instead, where it runs.

    query (B, H, T, D), key and value (B, Hkv, W, D), attention_mask (B, 1, T, W) bool -> (B, T, H, D)."""
    b, h, t, d = query.shape
    if (t > 1 or query.dtype != torch.float32) and not softcap:  # the fused kernel (no T x W scores stored)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    groups = h // key.shape[1]
    q = query.reshape(b, key.shape[1], groups * t, d)  # (B, Hkv, G*T, D)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scaling  # (B, Hkv, G*T, W)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keep = attention_mask if t == 1 else attention_mask.repeat(1, 1, groups, 1)  # one query: it broadcasts
    scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # (B, Hkv, G*T, D)
    return out.reshape(b, h, t, d).transpose(1, 2), None


AttentionInterface.register(ATTENTION, slot_attention)


@dataclass
class _Row:
    handle: Handle
    tokens: list[int]
    """Every token of the sequence whose keys and values are in the cache."""
    uniforms: Uniforms
    budget: int
    next: int = -1
    """The last sampled token: the next step's input (not in the cache yet)."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reused: int = 0
    group: int = -1
    """Rows of one group (copies of one prompt's computed cache) share it; a row alone is a group of its own."""
    shared: int = 0
    """How many first positions of the cache the row's group holds alike (its prompt's)."""


@dataclass
class _Kept:
    tokens: list[int]
    slot: int


class Scheduler:
    def __init__(
        self,
        model,
        stop_ids: tuple[int, ...],
        *,
        max_rows: int = 256,
        max_length: int | None = None,
        prefill_chunk: int = 512,
        version: Callable[[], int] = lambda: 0,
        on_step: Callable[[int], None] | None = None,
    ):
        """`max_rows`: most rows decoded together (more requests wait for a free slot); `on_step` hears the
        number of rows of each decode step (a server's batch-size metric)."""
        if max_rows < 1:
            raise ValueError(f"max_rows {max_rows}: at least one row is needed to generate anything")
        self.use(model)
        self.stops = set(stop_ids)
        self.max_rows, self.prefill_chunk, self.version = max_rows, prefill_chunk, version
        limit = getattr(self.config, "max_position_embeddings", None) or getattr(
            self.config, "n_positions", None
        )
        self.max_length = max_length or limit or 1 << 20
        self.cache = SlotCache()
        self.waiting: deque[Handle] = deque()
        self.rows: list[_Row] = []  # running, row i in slot i
        self.kept: list[_Kept] = []  # done sequences kept for their next turn, least recently used first
        self.lock = threading.Lock()
        self.prefilled = 0  # prompt tokens computed (for metrics: reuse shows as fewer)
        self.groups = itertools.count()
        self.on_step = on_step or (lambda rows: None)

    def use(self, model) -> None:
        """Sample with `model` from now on (the same weights' merged copy, say; kept caches stay valid)."""
        import inspect

        base = (
            model.get_base_model() if hasattr(model, "get_base_model") else model
        )  # peft: its LoRA layers stay in
        self.model, self.decoder, self.head, self.config = (
            model,
            base.get_decoder(),
            base.get_output_embeddings(),
            base.config,
        )
        # transformers renamed the decoder's cache argument (past_key_values -> cache, 5.2x): use the model's own
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        )
        self.fast = LlamaDecoder.of(
            base, slot_attention
        )  # the same floats, less Python; None: the model's own

    # ------------------------------------------------------------------------------------ requests

    def submit(self, request: Request) -> Handle:
        return self.add([Handle(request)])[0]

    def add(self, handles: list[Handle]) -> list[Handle]:
        """Queue requests made already (in this order: they join the running rows at the next step)."""
        with self.lock:
            self.waiting.extend(handles)
        return handles

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def fail(self, error: Exception) -> None:
        """The model raised: every running and waiting request fails with the error; the engine goes on."""
        with self.lock:
            handles = [r.handle for r in self.rows] + list(self.waiting)
            self.rows, self.kept = [], []
            self.waiting.clear()
        for h in handles:
            if not h.future.done():
                h.future.set_exception(error)

    def forget(self) -> None:
        """Drop every kept sequence (new weights make their cache stale)."""
        self.kept = []

    # ---------------------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self) -> None:
        """Admit what fits, then one decode step of every running row."""
        with self.engine_mode():
            self._admit()
            if self.rows:
                self._decode()

    @contextmanager
    def engine_mode(self):
        """The model in eval mode and on the engine's attention while inside; both given back after (a trainer's
        forward keeps its own). Wrap a run of steps in it once: switching a model's mode walks every module -
        measured, a fifth of a 2M-parameter model's decode step."""
        model, config = self.model, self.config
        training, attention = model.training, config._attn_implementation
        if training:
            model.eval()
        config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            if training:
                model.train()
            config._attn_implementation = attention

    def _admit(self) -> None:
        with self.lock:
            for handle in [h for h in self.waiting if h.cancelled.is_set()]:  # gone before they started
                self.waiting.remove(handle)
                self._finish_unstarted(handle, "cancelled")
            new: list[Handle] = []
            while self.waiting and len(self.rows) + len(new) < self.max_rows:
                handle = self.waiting.popleft()
                if len(handle.request.prompt) >= self.max_length or handle.request.max_tokens <= 0:
                    self._finish_unstarted(handle, "length")
                else:
                    new.append(handle)
        if new:
            self._prefill(new)

    def _prefill(self, handles: list[Handle]) -> None:
        """Place the new rows in slots [n, n + m) - the ones to compute first, then the copies of those whose
        context another new row has - and compute what their caches lack."""
        n = len(self.rows)
        distinct: list[_Row] = []
        copies: list[tuple[_Row, _Row]] = []
        by_context: dict[tuple[int, ...], _Row] = {}
        for handle in handles:
            req = handle.request
            row = _Row(handle, [], Uniforms(req.seed), min(req.max_tokens, self.max_length - len(req.prompt)))
            source = by_context.setdefault(tuple(req.prompt), row)
            (distinct.append(row) if source is row else copies.append((row, source)))
        # Room for every new row's whole sequence now: no growth (a copy of the buffers) while it decodes.
        self.cache.ensure(
            n + len(handles),
            max(len(r.handle.request.prompt) + r.budget for r in distinct + [row for row, _ in copies]) + 1,
        )
        beyond = n + len(handles)
        for slot, row in enumerate(distinct, n):
            self._take_slot(slot, beyond)
            row.reused = self._reuse(row, slot)
        logits = self._compute(distinct, n)  # (d, V)
        for row in distinct:
            row.group, row.shared = next(self.groups), len(row.tokens)
        for slot, (row, source) in enumerate(copies, n + len(distinct)):
            self._take_slot(slot, beyond)
            self.cache.copy(n + distinct.index(source), slot, len(source.tokens))
            row.tokens, row.reused = list(source.tokens), len(source.tokens)
            row.group, row.shared = source.group, source.shared
        self.rows += distinct + [row for row, _ in copies]
        index = {id(row): i for i, row in enumerate(distinct)}
        self._sample(
            distinct + [row for row, _ in copies],
            logits[[index[id(row)] for row in distinct] + [index[id(s)] for _, s in copies]],
            offset=n,
        )

    def _take_slot(self, slot: int, beyond: int) -> None:
        """Slot `slot` is about to hold a running row: a kept sequence there moves to a free slot at or past
        `beyond` (or, with none free, is dropped)."""
        for kept in self.kept:
            if kept.slot == slot:
                free = self._free_slot(beyond)
                if free is None:
                    self.kept.remove(kept)
                else:
                    self.cache.copy(slot, free, len(kept.tokens))
                    kept.slot = free
                return

    def _reuse(self, row: _Row, slot: int) -> int:
        """Take the longest kept sequence that the row's context extends into `slot`; how many tokens it saves."""
        prompt = row.handle.request.prompt
        best = max(
            (k for k in self.kept if len(k.tokens) < len(prompt) and prompt[: len(k.tokens)] == k.tokens),
            key=lambda k: len(k.tokens),
            default=None,
        )
        if best is None:
            return 0
        self.kept.remove(best)
        self.cache.copy(best.slot, slot, len(best.tokens))
        row.tokens = list(best.tokens)
        return len(best.tokens)

    def _compute(self, rows: list[_Row], lo: int) -> Tensor:
        """Run each row's missing context tokens (right-padded, in chunks of `prefill_chunk`) through the model
        into slots [lo, lo + len(rows)); the logits that predict each row's first new token (m, V)."""
        todo = [r.handle.request.prompt[len(r.tokens) :] for r in rows]
        done = [len(r.tokens) for r in rows]
        last: list[Tensor | None] = [None] * len(rows)
        device = self.device
        for start in range(0, max(map(len, todo)), self.prefill_chunk):
            chunk = [t[start : start + self.prefill_chunk] for t in todo]
            width = max(len(c) for c in chunk)
            ids = torch.tensor([c + [0] * (width - len(c)) for c in chunk], device=device)  # (m, T)
            positions = (
                torch.tensor(done, device=device)[:, None] + start + torch.arange(width, device=device)
            )
            span = int(positions.max()) + 1
            mask = torch.arange(span, device=device)[None, None] <= positions[:, :, None]  # (m, T, span)
            hidden = self._forward(ids, positions, mask[:, None], lo)  # (m, T, H)
            for i, c in enumerate(chunk):
                if c:  # the hidden state of the row's last token so far
                    last[i] = hidden[i, len(c) - 1]
        for r, t in zip(rows, todo):
            r.tokens += t
        self.prefilled += sum(map(len, todo))
        return self._logits(torch.stack(cast(list[Tensor], last)))  # every row has a token to compute

    def _decode(self) -> None:
        n, device = len(self.rows), self.device
        self.on_step(n)
        lengths = torch.tensor([len(r.tokens) for r in self.rows], device=device)
        ids = torch.tensor([[r.next] for r in self.rows], device=device)
        mask = torch.arange(int(lengths.max()) + 1, device=device)[None] <= lengths[:, None]  # (n, width)
        groups = self._groups() if self.fast is not None and self.fast.fused else None
        hidden = self._forward(ids, lengths[:, None], mask[:, None, None], 0, groups)[:, -1]  # (n, H)
        for r in self.rows:
            r.tokens.append(r.next)
        self._sample(self.rows, self._logits(hidden), offset=0)

    def _groups(self) -> tuple[Tensor, Tensor, Tensor]:
        """(leader, shared, order) of the running rows for `SlotCache.set_batch`: a group's first row in slot
        order leads it, and the order visits a group's rows together."""
        first: dict[int, int] = {}
        leader = [first.setdefault(r.group, i) for i, r in enumerate(self.rows)]
        device = self.device
        return (
            torch.tensor(leader, device=device),
            torch.tensor([r.shared for r in self.rows], device=device),
            torch.tensor(sorted(range(len(leader)), key=leader.__getitem__), device=device),
        )

    def _forward(
        self, ids: Tensor, positions: Tensor, mask: Tensor, lo: int, groups: tuple[Tensor, ...] | None = None
    ) -> Tensor:
        """The decoder's last hidden states (B, T, H) for tokens `ids` at `positions` of slots [lo, lo + B),
        attending where `mask` (B, 1, T, width) is true; their keys and values go into the cache. `groups`:
        which rows hold their first positions alike (`SlotCache.set_batch`)."""
        self.cache.set_batch(lo, lo + len(ids), positions, mask.shape[-1], groups)
        if self.fast is not None:
            return self.fast(ids, positions, mask, self.cache)
        return self.decoder(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: self.cache},
        ).last_hidden_state

    def _logits(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _sample(self, rows: list[_Row], logits: Tensor, offset: int) -> None:
        reqs = [r.handle.request for r in rows]
        device = logits.device
        drawn = sample(
            logits,
            torch.tensor([q.temperature for q in reqs], device=device),
            torch.tensor([q.top_p for q in reqs], device=device),
            torch.tensor(
                [0.0 if q.temperature <= 0 else r.uniforms.next() for q, r in zip(reqs, rows)], device=device
            ),
            max(q.top_logprobs for q in reqs),
        )
        tokens, logprobs = drawn.tokens.tolist(), drawn.logprobs.tolist()
        ended = []
        for i, (row, req, token) in enumerate(zip(rows, reqs, tokens)):
            row.ids.append(token)
            row.logprobs.append(logprobs[i])
            row.next = token
            stop = req.on_token is not None and req.on_token(token, drawn, i)
            if row.handle.cancelled.is_set():
                ended.append((offset + i, "cancelled"))
            elif token in self.stops or stop:
                ended.append((offset + i, "stop"))
            elif len(row.ids) >= row.budget:
                ended.append((offset + i, "length"))
        for slot, reason in sorted(ended, reverse=True):
            self._end(slot, reason)

    def _end(self, slot: int, reason: str) -> None:
        """Row `slot` is done: its result goes out, the last running row moves into its slot; with `keep`, its
        cache is kept in a free slot past the running rows (the least recently kept one gives way)."""
        row = self.rows[slot]
        last = len(self.rows) - 1
        if row.handle.request.keep and reason != "cancelled":
            free = self._free_slot(len(self.rows))
            if free is None and len(self.kept) < self.max_rows:  # room for as many kept as running rows
                self.cache.ensure(self.cache.slots + 1, self.cache.length)
                free = self._free_slot(len(self.rows))
            if free is None and self.kept:
                free = self.kept.pop(0).slot
            if free is not None:
                self.cache.copy(slot, free, len(row.tokens))
                self.kept.append(_Kept(list(row.tokens), free))
        if slot != last:
            self.cache.copy(last, slot, len(self.rows[last].tokens))
            self.rows[slot] = self.rows[last]
        self.rows.pop()
        row.handle.future.set_result(
            Completion(row.handle.request.prompt, row.ids, row.logprobs, reason, self.version(), row.reused)
        )

    def _free_slot(self, first: int) -> int | None:
        """A slot at or past `first` that no kept sequence holds."""
        used = {k.slot for k in self.kept}
        return next((s for s in range(first, self.cache.slots) if s not in used), None)

    def _finish_unstarted(self, handle: Handle, reason: str) -> None:
        handle.future.set_result(Completion(handle.request.prompt, [], [], reason, self.version()))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device
