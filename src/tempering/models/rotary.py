"""Rotary position embeddings that come out the same in every process.

transformers computes a rotary embedding's cos and sin on the fly, in fp32, with torch's CPU `cos` - which
calls MKL's vector math, and MKL picks its code path at run time: in about one process in four (measured
here: 7 of 25; with `MKL_CBWR=COMPATIBLE`, 0 of 25) the cos of the main thread's share of a batch comes out
one ulp apart. In bf16 that ulp flips a rounding (808 of 108,288 elements of a 4 x 423-token SmolLM2
prefill), and the sampled tokens differ from there on: a killed bf16 run would not resume exactly.
`exact_rotary` replaces each such module by a table of cos and sin per position, computed once in float64
by numpy (one code path, no threads) and rounded once to fp32 - shared by the trainer's forward and the
engine's, since the sampling copies are copies of the model. The table also keeps the frequencies in fp32
when a copy is cast to bf16 (`Module.to` casts transformers' `inv_freq` buffer: a 2^-9 relative error in
the angle, 0.04 rad at position 400)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

STATIC = {"default", "linear", "llama3", "yarn"}
"""Rope types whose frequencies do not change with the sequence (dynamic and longrope ones do: left alone)."""


class RotaryTable(nn.Module):
    """(cos, sin) of each position's angles, (B, T, D) in `x`'s dtype, as transformers' rotary modules give them;
    from a table grown (doubling) to the largest position asked, one per device."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.inv_freq = rotary.inv_freq.detach().to("cpu", torch.float32).numpy().copy()  # numpy: no cast
        self.scaling = float(rotary.attention_scaling)
        self.tables: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.table(int(position_ids.max()) + 1, x.device)
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    def table(self, positions: int, device: torch.device) -> tuple[Tensor, Tensor]:
        cos, sin = self.tables.get(device, (None, None))
        if cos is None or len(cos) < positions:
            n = max(positions, 256, 2 * (0 if cos is None else len(cos)))
            angles = np.arange(n, dtype=np.float32)[:, None] * self.inv_freq[None, :]  # fp32, as transformers
            angles = np.concatenate([angles, angles], axis=1).astype(np.float64)
            cos, sin = (
                torch.from_numpy((f(angles) * self.scaling).astype(np.float32)).to(device)
                for f in (np.cos, np.sin)
            )
            self.tables[device] = cos, sin
        return cos, sin


def exact_rotary(model: nn.Module) -> nn.Module:
    """`model` with each rotary embedding of a static rope type (`STATIC`) replaced by a `RotaryTable`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            rope = getattr(getattr(child, "config", None), "rope_parameters", None) or {}
            if (
                getattr(child, "rope_type", None) in STATIC
                and hasattr(child, "inv_freq")
                and hasattr(child, "attention_scaling")
                and "mrope_section" not in rope
            ):  # (multimodal: 3-D positions)
                setattr(parent, name, RotaryTable(child))
    return model
