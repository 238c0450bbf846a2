"""Sampling one token per row, each row with its own temperature, top-p and random numbers.

A row's draw is inverse-CDF sampling with a uniform number that comes from the row's own stream (its
request's seed), not from a generator shared by the batch: a row's tokens then depend only on its seed,
its context and the weights - not on which rows share the step, nor on when it joined the batch. (The
floats of a batched forward may still differ in the last bits with the batch's shape; see
docs/concepts/determinism.md.)

bf16 logits on a CPU with the kernels of `kernels/` are sampled there (`sample_rows`: the same inverse-CDF
draw in one pass over each row's logits, its weights in fp32; measured 0.5 vs 5.2 ms for 32 rows of
SmolLM2's 49,152 tokens), unless a row asks for top-p or top log-probs. fp32 logits (an fp32 engine) always take the ATen
path below, so their draws do not move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tempering.inference.kernels import decode_ops

BLOCK = 64
"""Uniform numbers drawn from a row's generator at a time."""


class Uniforms:
    """A row's stream of uniform numbers in [0, 1), from its own seeded generator, drawn in blocks."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed % (1 << 64))
        self.block, self.used = torch.empty(0), 0

    def next(self) -> float:
        if self.used == len(self.block):
            self.block, self.used = torch.rand(BLOCK, generator=self.generator), 0
        self.used += 1
        return float(self.block[self.used - 1])


@dataclass
class Sampled:
    tokens: Tensor
    """(B,) the sampled token of each row."""
    logprobs: Tensor
    """(B,) its log-prob under the row's sampling distribution: softmax(logits / temperature), the full
    distribution (not the top-p cut), as the trainer recomputes it; greedy rows at temperature 1."""
    raw: Tensor | None = None
    """(B,) its log-prob under the model's own distribution (temperature 1), when `top_logprobs` was asked."""
    top: list[list[tuple[int, float]]] | None = None
    """Per row, the `top_logprobs` most likely (token, raw log-prob), most likely first."""


def sample(
    logits: Tensor, temperature: Tensor, top_p: Tensor, uniforms: Tensor, top_logprobs: int = 0
) -> Sampled:
    """logits (B, V), temperature (B,) (0 = greedy), top_p (B,), uniforms (B,) -> one token per row."""
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and top_logprobs <= 0:
        ops = decode_ops()
        if ops is not None and not bool((top_p < 1.0).any()):
            tokens, logprobs = ops.sample_rows(logits.contiguous(), temperature.float(), uniforms.float())
            return Sampled(tokens, logprobs)
    logits = logits.float()
    greedy = temperature <= 0
    scaled = not bool(((temperature == 1.0) | greedy).all())  # dividing by 1 changes nothing: a pass saved
    z = logits / torch.where(greedy, 1.0, temperature)[:, None] if scaled else logits  # (B, V)
    top = z.amax(-1, keepdim=True)  # (max(): 4x slower, for the indices it also returns)
    weights = torch.sub(z, top).exp_()  # unnormalised
    total = weights.sum(-1, keepdim=True)
    if bool((top_p < 1.0).any()):
        weights, order = weights.sort(dim=-1, descending=True)
        outside = (
            weights.cumsum(-1) - weights > top_p[:, None] * total
        )  # keep the smallest set reaching top_p
        weights = weights.masked_fill(outside, 0.0)
    else:
        order = None
    cdf = weights.cumsum(-1)  # (B, V)
    index = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).clamp_max(z.shape[-1] - 1)
    tokens = index.squeeze(-1) if order is None else order.gather(-1, index).squeeze(-1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, z.argmax(-1), tokens)
    chosen = (
        z.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1) - total.squeeze(-1).log()
    )  # log-softmax
    if top_logprobs <= 0:
        return Sampled(tokens, chosen)
    raw = torch.log_softmax(logits, dim=-1)
    values, ids = raw.topk(top_logprobs, dim=-1)
    return Sampled(
        tokens,
        chosen,
        raw.gather(-1, tokens[:, None]).squeeze(-1),
        [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())],
    )
