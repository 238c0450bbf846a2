"""One policy update on a rollout batch: PPO epochs over shuffled minibatches."""

from __future__ import annotations

from collections import defaultdict

import torch

from tempering.algos import KL_ESTIMATORS, LossInputs, masked_mean
from tempering.algos.losses import PolicyLoss
from tempering.models.forward import model_device, response_logprobs
from tempering.rollout.batch import RolloutBatch


def update_policy(
    model,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    *,
    policy_loss: PolicyLoss,
    generator: torch.Generator,
    ppo_epochs: int = 1,
    minibatches: int = 1,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg: str = "token-mean",
    norm_length: int | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    max_grad_norm: float = 1.0,
    temperature: float = 1.0,
    gradient_checkpointing: bool = False,
) -> dict[str, float]:
    """Run `ppo_epochs` x `minibatches` optimizer steps; returns the mean of each metric over them.
    `gradient_checkpointing` recomputes activations in the backward pass, for this update only (sampling
    keeps its KV cache). Rows that share a prompt are one packed sequence either way (`models.forward`)."""
    assert batch.advantages is not None, "compute advantages before the update"
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    without_dropout(model)
    device = model_device(model)
    sums: dict[str, float] = defaultdict(float)
    n_steps = 0
    for _ in range(ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for index in order.chunk(minibatches):
            mb = batch.select(index).trim().to(device)
            mask = mb.response_mask
            logprobs, entropy = response_logprobs(
                model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.attention,
                temperature=temperature, with_entropy=True,
            )
            pg_loss, pg_metrics = policy_loss(
                LossInputs(logprobs, mb.old_logprobs, mb.advantages, mask, mb.is_weights),
                clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg=loss_agg, norm_length=norm_length,
            )
            entropy_mean = masked_mean(entropy, mask)
            loss = pg_loss - entropy_coef * entropy_mean
            if kl_coef > 0:
                kl = masked_mean(KL_ESTIMATORS[kl_estimator](logprobs, mb.ref_logprobs), mask)
                loss = loss + kl_coef * kl
                sums["actor/kl_loss"] += float(kl.detach())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            n_steps += 1
            sums["actor/pg_loss"] += float(pg_loss.detach())
            sums["actor/entropy"] += float(entropy_mean.detach())
            sums["actor/grad_norm"] += float(grad_norm)
            for k, v in pg_metrics.items():
                sums[f"actor/{k}"] += float(v)
    if gradient_checkpointing:
        model.gradient_checkpointing_disable()
    model.train()
    return {k: v / n_steps for k, v in sums.items()}


def without_dropout(model: torch.nn.Module) -> None:
    """Eval mode everywhere (no dropout: a model's own, or LoRA's), except the flag of the layers that
    checkpoint their activations (transformers checkpoints a layer only while it is in train mode). The
    sampler's log-probs come from eval mode; the update's must come from the same distribution, or the PPO
    ratio is not 1 before the first step and clipping acts on noise."""
    model.eval()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True
