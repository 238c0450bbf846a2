"""Hand-written CPU kernels for the bf16 decode step, built from source at first use, with the ATen path as
the fallback everywhere (`decode.cpp`).

- `decode_attention`, the attention of a one-token step. SDPA's CPU flash kernel runs a small matrix product
  per block of keys, which at one query per row costs more than reading the keys (measured at 32 rows of
  SmolLM2, 450 positions: 1.36 ms a layer, when reading its keys and values takes 0.4 ms); inductor's
  generated loops were slower still. This kernel streams each row's keys once with AVX512-BF16 dot
  products, for the G query heads of a key head at once, and its values once: measured 0.85 ms there.
- `rope_attend`, `rms_norm`, `add_rms_norm`, `silu_mul`: the rest of a layer's step around its four matmuls,
  in three calls instead of ~30 ATen ops (each a dispatch and a pass over memory: measured, ~20 ms of a
  72 ms 32-row SmolLM2 decode step, the matmuls ~25). They round to bf16 where transformers' bf16
  ops do, so the hidden states are the model's own up to the order of a norm's sum. `rope_attend` also
  reads a group's shared prompt from one row's slot (the scheduler's `groups`), once for all its rows.
- `sample_rows`, the draw from bf16 logits in one pass a row (`sampling.sample`; 0.5 vs 5.2 ms at 32 rows
  of a 49,152-token vocabulary).
No library ships such kernels for CPUs that torch can call (vLLM's CPU build has its own, inside vLLM).

The build needs a C++ compiler and ninja (a dependency of the package) and runs once per source version
(torch keeps it in its extensions cache, ~30 s). Where the CPU lacks AVX512-BF16, the build fails, or
`TEMPERING_KERNELS=0` is set, `decode_ops` is None and the engine runs transformers' ops and SDPA: the same
step up to bf16 rounding.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def decode_ops_for(head_dim: int, groups: int):
    """The decode kernels (`decode_ops`) for heads of `head_dim` with `groups` query heads per key head, or
    None where they do not run (head_dim a multiple of 32 up to 128, up to 16 groups, and `decode_ops`)."""
    if head_dim % 32 or head_dim > 128 or groups > 16:
        return None
    return decode_ops()


def load_decode_attention() -> Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor] | None:
    """`decode_attention(q, k, v, lengths, scale)`, built on the first call; None where it cannot run here.

    q (B, Hkv, G, D), k, v (B, Hkv, W, D), all bf16 with unit stride in D; lengths (B,) int64:
    row b attends to positions [0, lengths[b]) -> (B, Hkv, G, D) bf16."""
    ops = decode_ops()
    return None if ops is None else ops.decode_attention


@functools.cache
def decode_ops():
    """The built module of `decode.cpp` (its functions documented there), or None where it cannot run here."""
    if os.environ.get("TEMPERING_KERNELS", "1") == "0":
        return None
    if not {"avx512f", "avx512_bf16"} <= _cpu_flags():
        return None
    try:
        from torch.utils.cpp_extension import load

        flags = ["-O3", "-march=native", "-mavx512f", "-mavx512bf16", "-fopenmp"]
        return load("tempering_decode", [str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - a machine without a compiler samples with transformers' ops
        log.warning("tempering: the decode kernels did not build (%s); using ATen's", str(e)[:200])
        return None
