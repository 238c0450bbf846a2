"""The machine's matmul ceiling at a model's own shapes, measured where the bench runs.

    .venv/bin/python bench/ceiling.py [MODEL] [--rows 32 64 256] [--threads 2]

A decode step of R rows multiplies an (R, in) activation by every linear layer's weight: the decoder's
projections, layer after layer, and the output head. `decode_ceiling` times exactly that sequence of
matmuls - nothing else: no attention, norms, sampling or Python - with the weights the engine samples
from (bf16 packed for oneDNN, as `inference.engine.prepacked` packs them, or fp32 plain), streaming
them from memory as a real step does. Its time is a floor on a decode step, so R / time is a ceiling on
tokens/s; the GFLOP/s it reaches is the machine's matmul rate at those shapes. `update_ceiling` does the
same for a training step's matmuls over T tokens: forward, and the backward's two products per layer
(input and weight gradients; frozen weights, as LoRA's base, need only the input's).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor


def linear_weights(model) -> list[Tensor]:
    """Every linear weight a token's forward multiplies by, in order (tied head included once)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = [m.weight for m in base.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    return [*weights, base.get_output_embeddings().weight]


def _timed(step, repeats: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    step()  # warm-up (oneDNN picks and caches its kernels)
    best = float("inf")
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        step()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


@torch.no_grad()
def decode_ceiling(model, rows: int, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """One decode step's matmuls at `rows` rows in `dtype`: seconds, GFLOP/s and the tokens/s ceiling."""
    weights = [w.detach().to(dtype) for w in linear_weights(model)]
    flops = 2 * rows * sum(w.numel() for w in weights)
    device = weights[0].device
    if dtype == torch.bfloat16 and device.type == "cpu":
        layers = [_packed(w, rows) for w in weights]
    else:
        layers = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype, device=device) for w in weights}

    def step() -> None:
        for w, layer in zip(weights, layers):
            layer(inputs[w.shape[1]])

    seconds = _timed(step, repeats)
    return {"seconds": seconds, "gflops": flops / seconds / 1e9, "tokens_per_s": rows / seconds}


def _packed(weight: Tensor, rows: int):
    """`weight` as the engine's bf16 copy multiplies by it (oneDNN-packed), or plain where torch has no oneDNN."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return lambda x: torch.nn.functional.linear(x, weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def update_ceiling(
    model, tokens: int, dtype: torch.dtype, frozen: bool = False, repeats: int = 3
) -> dict[str, float]:
    """A training step's matmuls over `tokens` tokens in `dtype`: forward (x W^T) and backward (the input's
    gradient g W, and - unless `frozen` - the weight's g^T x) for every linear weight. Seconds, GFLOP/s and
    the trained tokens/s ceiling."""
    weights = [w.detach().to(dtype) for w in linear_weights(model)]
    device = weights[0].device
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=dtype, device=device) for w in weights}
    grads = {w.shape[0]: torch.randn(tokens, w.shape[0], dtype=dtype, device=device) for w in weights}
    products = 2 if frozen else 3
    flops = 2 * tokens * products * sum(w.numel() for w in weights)

    @torch.no_grad()
    def step() -> None:
        for w in weights:
            x, g = inputs[w.shape[1]], grads[w.shape[0]]
            torch.nn.functional.linear(x, w)
            g @ w
            if not frozen:
                g.t() @ x

    seconds = _timed(step, repeats)
    return {"seconds": seconds, "gflops": flops / seconds / 1e9, "tokens_per_s": tokens / seconds}


def main() -> None:
    from tempering.checkpoint import resolve_model
    from tempering.models.loading import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model)).eval()
    print(f"{'rows':>5} {'precision':<9} {'ms/step':>8} {'GFLOP/s':>8} {'tokens/s ceiling':>17}")
    for rows in args.rows:
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            c = decode_ceiling(model, rows, dtype)
            print(
                f"{rows:>5} {name:<9} {c['seconds'] * 1e3:>8.1f} {c['gflops']:>8.0f} {c['tokens_per_s']:>17.0f}"
            )


if __name__ == "__main__":
    main()
