"""Masked reductions over (B, T) token tensors. `mask` is 1.0 for tokens that count, 0.0 for padding."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is set; values (B, T), mask (B, T) -> scalar, or (B,) with dim=-1."""
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked-in entries; an all-masked row gives 0, not NaN."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def sequence_mean(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """Mean of per-sequence values (B,) over the rows with at least one token in `mask` (B, T) -> scalar;
    a fully masked row is left out of the count, as verl's `agg_loss` leaves it (0 if every row is)."""
    rows = (mask.sum(-1) > 0).to(per_sequence.dtype)  # (B,)
    return (per_sequence * rows).sum() / rows.sum().clamp_min(1.0)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked-in entries (a scalar)."""
    mean = masked_mean(values, mask)
    n = mask.sum()
    var = masked_sum((values - mean) ** 2, mask) / n.clamp_min(1.0)
    if unbiased:
        var = var * n / (n - 1).clamp_min(1.0)
    return var


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values - mean) / std over masked-in entries (statistics ignore padding)."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean
