"""Optimizer and learning-rate schedule (warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8)


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, schedule: str = "constant"
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup_steps`, then `constant` or `cosine` decay to 10% at `total_steps`."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown schedule '{schedule}'; valid: constant, cosine")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
