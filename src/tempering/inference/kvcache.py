"""The KV cache the engine manages: one slot per sequence, preallocated, read and written in place.

Per layer, keys and values live in buffers of shape (slots, kv_heads, length, head_dim). A sequence
occupies one slot, its tokens at positions 0, 1, ... of that slot (no left padding: every row starts at 0
and has a length of its own). The engine keeps the rows it is decoding in the slots [0, n), so that a
decode step's attention reads the views `K[:n, :, :width]` - no gather, no concatenation, no copy per step
(transformers' DynamicCache concatenates a step's keys onto the whole cache: measured, half of a SmolLM2
decode step). Sequences that are done but kept for a next turn (their prefix reused) sit in slots past
the active ones; the engine tracks where.

The model reads and writes the buffers through `update`, the one method of transformers' cache interface
its attention layers call (duck-typed: every architecture the project tests - Llama, Mistral, Qwen2,
Qwen3, Gemma, GPT-2 - runs its own forward over this cache, with a prepared 4-D mask and per-row
positions, and gives the logits of the plain full-sequence pass; the engine's own Llama-family forward,
`decoder.py`, calls it the same way). Before each forward the engine says (`set_batch`) which slots the
batch covers, where each new token goes and how many positions attention reads.

Memory is what the sequences need: the buffers start small and grow (doubling, one copy) when a batch
needs more slots or positions.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SlotCache:
    def __init__(self, slots: int = 8, length: int = 256):
        self.initial = (slots, length)
        self.slots, self.length = slots, length
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.lo, self.hi, self.width = 0, 0, 0
        self._write: Tensor | None = None  # (B, T) positions the batch's new tokens are written at
        self._at: Tensor | None = None  # the same places as rows of a buffer's (-1, D) view, (B * H * T,)
        self.groups: tuple[Tensor, ...] | None = None

    def set_batch(
        self, lo: int, hi: int, write: Tensor, width: int, groups: tuple[Tensor, ...] | None = None
    ) -> None:
        """The next forward covers slots [lo, hi); its tokens go to positions `write` (B, T); attention reads
        positions [0, width). `groups` (leader, shared, order), each (B,): row b's first shared[b] positions
        are the same as row leader[b]'s, and `order` lists the rows with those of a group together - for a
        kernel that reads a group's shared positions once (`kernels`, `rope_attend`); None: each row alone."""
        self.ensure(hi, max(width, int(write.max()) + 1))
        self.lo, self.hi, self.width, self.groups = lo, hi, width, groups
        self._write = write
        self._at = None  # known at the first layer (the number of key/value heads)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """transformers' cache interface: store a layer's new keys and values (B, H, T, D); return the keys
        and values attention reads (B, H, width, D), views into the buffers."""
        if layer_idx == len(self.k):  # the first forward allocates, in the model's own shapes and dtype
            shape = (self.slots, key.shape[1], self.length, key.shape[3])
            # Zeros, not empty: a masked position weighs 0 in attention, and 0 x NaN from stale memory is NaN.
            self.k.append(torch.zeros(shape, dtype=key.dtype, device=key.device))
            self.v.append(torch.zeros(shape, dtype=value.dtype, device=value.device))
        k, v = self.k[layer_idx], self.v[layer_idx]
        _, h, _, d = key.shape
        at = self._at
        if at is None:  # (slot, head, position) -> row of the (slots * H * length, D) view; every layer's
            assert self._write is not None, "set_batch comes before the forward"  # buffers share a shape
            slots = torch.arange(self.lo, self.hi, device=key.device)[:, None, None] * h
            heads = torch.arange(h, device=key.device)[None, :, None]
            at = self._at = ((slots + heads) * self.length + self._write[:, None, :]).reshape(-1)
        k.view(-1, d).index_copy_(0, at, key.reshape(-1, d))  # in place, one kernel per tensor
        v.view(-1, d).index_copy_(0, at, value.reshape(-1, d))
        return k[self.lo : self.hi, :, : self.width], v[self.lo : self.hi, :, : self.width]

    def buffers(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """Layer `layer_idx`'s whole key and value buffers (slots, H, length, D), allocated by an earlier
        `update`: for a kernel that writes the batch's keys and values itself, at `set_batch`'s positions."""
        return self.k[layer_idx], self.v[layer_idx]

    def ensure(self, slots: int, length: int) -> None:
        """Room for `slots` sequences of `length` positions (grown by doubling; contents kept)."""
        if slots <= self.slots and length <= self.length:
            return
        new_slots, new_length = self.slots, self.length
        while new_slots < slots:
            new_slots *= 2
        while new_length < length:
            new_length *= 2
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = old.new_zeros((new_slots, old.shape[1], new_length, old.shape[3]))
                new[: self.slots, :, : self.length] = old
                buffers[i] = new
        self.slots, self.length = new_slots, new_length

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot `src`'s first `length` positions into slot `dst` (every layer)."""
        if src == dst or length <= 0:
            return
        for buffers in (self.k, self.v):
            for b in buffers:
                b[dst, :, :length] = b[src, :, :length]

    def clear(self) -> None:
        """Free the buffers (the next forward allocates them again, at the starting size)."""
        self.k, self.v = [], []
        self.slots, self.length = self.initial
