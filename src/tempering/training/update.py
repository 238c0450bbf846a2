"""One step's update on a rollout batch: the critic on the returns, then PPO epochs of the policy over
shuffled minibatches - the same code on the trainer and on every data-parallel rank."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from tempering.algos import KL_ESTIMATORS, LossInputs, masked_mean
from tempering.algos.losses import PolicyLoss
from tempering.models.forward import model_device, response_logprobs
from tempering.models.loading import compute_dtype, mixed_precision
from tempering.rollout.batch import RolloutBatch
from tempering.seeding import step_generator
from tempering.training.critic import update_critic
from tempering.training.data_parallel import DataParallel, shares, unit_share


@dataclass(frozen=True)
class UpdateSettings:
    """How `update_policy` runs, built once from the config (`from_config`); the loss's own hyper-parameters
    are bound to the loss instead (`tempering.roles.bind_policy_loss`)."""

    epochs: int = 1
    """PPO epochs: passes over each rollout batch."""
    minibatches: int = 1
    """Optimizer steps per epoch."""
    loss_agg: str = "token-mean"
    """The loss's aggregation: a data-parallel rank scales its part by its share of tokens or of sequences."""
    kl_estimator: str = "k3"
    """KL to the reference in the loss (with `kl_coef` > 0)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold."""
    temperature: float = 1.0
    """The sampler's temperature: log-probs are those of the distribution the tokens were drawn from."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass, for the update only (sampling keeps its KV cache)."""
    compute: torch.dtype = torch.float32
    """bfloat16 runs each minibatch's forward under autocast (`mixed_precision`)."""

    @classmethod
    def from_config(cls, cfg) -> UpdateSettings:
        algo = cfg.algo
        return cls(
            epochs=algo.ppo_epochs,
            minibatches=algo.minibatches,
            loss_agg=algo.loss_agg,
            kl_estimator=algo.kl_estimator,
            entropy_coef=algo.entropy_coef,
            max_grad_norm=algo.max_grad_norm,
            temperature=cfg.rollout.temperature,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            compute=compute_dtype(cfg.model.compute, cfg.run.device),
        )


def policy_logprobs(
    model, mb: RolloutBatch, temperature: float, compute: torch.dtype, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's log-probs of a minibatch's response tokens (B, T) (and entropies, with `with_entropy`)
    under `compute`'s autocast: the forward of the update, and of the recomputation of pi_old."""
    with mixed_precision(model_device(model), compute):
        return response_logprobs(
            model,
            mb.prompt_ids,
            mb.prompt_mask,
            mb.response_ids,
            mb.attention,
            temperature=temperature,
            with_entropy=with_entropy,
        )


def update_policy(
    model,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    loss: PolicyLoss,
    settings: UpdateSettings,
    generator: torch.Generator,
    kl_coef: float = 0.0,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """Run `settings.epochs` x `settings.minibatches` optimizer steps of `loss` (bound to its hyper-parameters:
    called as `loss(inputs)`); returns the mean of each metric over them. Rows that share a prompt are one
    packed sequence (`models.forward`). `dp`: this is one of M data-parallel ranks; it runs its part of each
    minibatch (`data_parallel`) - a seq-mean-token-sum-norm loss then needs a bound `norm_length`, as the
    run's has (a rank's part is narrower than the minibatch)."""
    assert batch.advantages is not None, "compute advantages before the update"
    s = settings
    if s.gradient_checkpointing:
        activation_checkpointing(model, True)
    without_dropout(model)
    device = model_device(model)
    sums: dict[str, float] = defaultdict(float)
    n_steps = 0
    params = [p for p in model.parameters() if p.requires_grad]
    tok = seq = 1.0  # this rank's share of the minibatch's tokens and sequences (all of them, without `dp`)
    for _ in range(s.epochs):
        for index in batch.minibatches(s.minibatches, generator):
            if dp is not None:
                mine, counts = dp.part(index)
                tok, seq = shares(batch.loss_mask, index, mine, counts)
                index = mine
            mb = batch.select(index).trim().to(device)
            mask = mb.loss_mask  # without the tokens the mismatch correction rejected
            logprobs, entropy = policy_logprobs(model, mb, s.temperature, s.compute, with_entropy=True)
            pg_loss, pg_metrics = loss(
                LossInputs(logprobs, mb.old_logprobs, mb.advantages, mask, mb.is_weights)
            )
            pg_loss = pg_loss * unit_share(s.loss_agg, tok, seq)  # (x 1.0 is exact: no change without `dp`)
            entropy_mean = masked_mean(entropy, mask) * tok
            total = pg_loss - s.entropy_coef * entropy_mean
            if kl_coef > 0:
                kl = masked_mean(KL_ESTIMATORS[s.kl_estimator](logprobs, mb.ref_logprobs), mask) * tok
                total = total + kl_coef * kl
                sums["actor/kl_loss"] += float(kl.detach())
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            if dp is not None:
                dp.allreduce_grads(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)
            optimizer.step()
            n_steps += 1
            sums["actor/pg_loss"] += float(pg_loss.detach())
            sums["actor/entropy"] += float(entropy_mean.detach())
            sums["actor/grad_norm"] += float(grad_norm)
            for k, v in pg_metrics.items():
                sums[f"actor/{k}"] += float(v) * tok
    if s.gradient_checkpointing:
        activation_checkpointing(model, False)
    model.train()
    if dp is not None:
        sums = dp.allreduce_metrics(sums, keep=("actor/grad_norm",))
    return {k: v / n_steps for k, v in sums.items()}


def update_models(
    cfg,
    models,
    batch: RolloutBatch,
    step: int,
    *,
    loss: PolicyLoss,
    settings: UpdateSettings,
    kl_coef: float,
    timer,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """The critic on the returns, then PPO epochs of the policy (after the critic's warm-up). `models` has
    `policy`, `optimizer`, `critic`, `critic_optimizer` (a `TrainState`, or a data-parallel replica); the
    learning-rate schedule is the caller's."""
    algo = cfg.algo
    metrics: dict[str, float] = {}
    if models.critic is not None:
        with timer("critic"):
            metrics |= update_critic(
                models.critic,
                models.critic_optimizer,
                batch,
                generator=step_generator(cfg.run.seed, step, 3),
                epochs=algo.critic.epochs,
                minibatches=algo.minibatches,
                clip_range=algo.critic.value_clip,
                max_grad_norm=algo.max_grad_norm,
                compute=settings.compute,
                dp=dp,
            )
    with timer("update"):
        train_batch = batch.informative() if algo.skip_zero_advantage else batch
        if models.critic is None or step > algo.critic.warmup_steps:
            metrics |= update_policy(
                models.policy,
                models.optimizer,
                train_batch,
                loss,
                settings,
                step_generator(cfg.run.seed, step, 1),
                kl_coef,
                dp,
            )
    metrics["actor/trained_fraction"] = len(train_batch) / len(batch)
    return metrics


def activation_checkpointing(model: torch.nn.Module, enable: bool) -> None:
    """Recompute each layer's activations in the backward pass (or stop). transformers 5 renamed it from
    `gradient_checkpointing_*`, whose old names now warn on every call; the old ones stay for the releases
    before the rename."""
    if hasattr(model, "activation_checkpointing_enable"):
        if enable:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif enable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def without_dropout(model: torch.nn.Module) -> None:
    """Eval mode everywhere (no dropout: a model's own, or LoRA's), except the flag of the layers that
    checkpoint their activations (transformers checkpoints a layer only while it is in train mode). The
    sampler's log-probs come from eval mode; the update's must come from the same distribution, or the PPO
    ratio is not 1 before the first step and clipping acts on noise."""
    model.eval()
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True
