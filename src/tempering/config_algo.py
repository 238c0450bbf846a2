"""The configuration sections of the update and the reward: the algorithm (estimator, loss, KL, critic) and
the reward's components, guards and controls. `tempering.config` assembles them with the rest
(`config_sections`) into `RunConfig`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tempering.config_sections import Section


class CriticSection(Section):
    lr: float = Field(1e-4, gt=0.0)
    """Critic learning rate (estimators that need a critic: gae)."""
    value_clip: float = Field(0.2, gt=0.0)
    """Clip range of PPO's clipped value loss."""
    epochs: int = Field(1, ge=1)
    """Passes of the critic over each rollout batch."""
    warmup_steps: int = Field(0, ge=0)
    """RL steps during which only the critic learns (the policy waits for useful values)."""


class AlgoSection(Section):
    estimator: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, or
    `package.module:function` (see docs/concepts/algorithms.md)."""
    scale_by_std: bool = True
    """GRPO: divide by the group's std (False = Dr. GRPO)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount (reinforce_pp, gae)."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    whiten_advantages: bool = False
    """Whiten advantages over the batch after the estimator (common with gae)."""
    policy_loss: str = "ppo_clip"
    """Policy loss: ppo_clip, vanilla, gspo (sequence-level ratio; the paper's objective with loss_agg
    seq-mean-token-mean and clip ratios 3e-4 / 4e-4), cispo (clipped, stop-gradient weights on every token)
    (see `tempering.algos.POLICY_LOSSES`)."""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses are reduced to a scalar (seq-mean-token-sum-norm divides by rollout.max_new_tokens)."""
    lr: float = Field(1e-4, gt=0.0)
    """Policy learning rate."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warm-up, in RL steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    clip_ratio: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO clip range epsilon."""
    clip_ratio_low: float | None = Field(None, gt=0.0, le=1.0)
    """Lower clip range (default clip_ratio; 1.0 = no lower bound, CISPO's usual setting)."""
    clip_ratio_high: float | None = Field(None, gt=0.0)
    """Upper clip range (default clip_ratio; larger = DAPO's clip-higher, e.g. 0.28)."""
    clip_ratio_c: float | None = Field(None, gt=1.0)
    """Dual-clip constant (> 1, e.g. 3.0): caps the loss of negative-advantage tokens. None = off."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    minibatches: int = Field(2, ge=1)
    """Optimizer steps per epoch (the batch is split into this many minibatches)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL to the frozen reference; 0 skips the reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """`loss`: a term of the policy loss (GRPO); `reward`: a per-token penalty in the reward (PPO, REINFORCE++)."""
    kl_target: float | None = Field(None, gt=0.0)
    """Adaptive KL: steer kl_coef toward this KL per token (Ziegler et al.); None = fixed coefficient."""
    kl_horizon: int = Field(10000, ge=1)
    """Adaptive KL horizon, in samples: a step of B samples moves kl_coef by at most 20% * B / horizon."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping threshold."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more tasks until the batch is full."""
    max_sampling_rounds: int = Field(3, ge=1)
    """DAPO: at most this many sampling rounds per step (the batch may stay short after them)."""
    guidance: Literal["none", "reference"] = "none"
    """Off-policy guidance (LUFFY): `reference` puts the task's reference solution in place of the last sample
    of every group whose samples all failed, run and scored like a sample, with the policy's log-probs
    (`rollout.guidance`). Single-turn tasks with a reference solution that fits `rollout.max_new_tokens`;
    `train/guided_groups` counts them."""
    correction: Literal["none", "tis", "mis"] = "none"
    """Train/inference mismatch correction (`algos.correction`): the trainer recomputes pi_old and weights each
    token (or sequence) by pi_old / mu, truncated at `correction_cap` (tis), or rejects it above the cap (mis:
    out of the losses' mask and normaliser, as verl's rejection sampling). `none` keeps the sampler's
    log-probs as pi_old (bypass)."""
    correction_level: Literal["token", "sequence"] = "token"
    """Per-token ratios, or each sequence's geometric mean."""
    correction_cap: float = Field(2.0, gt=0.0)
    """The truncation / masking threshold C (verl's default 2.0)."""
    critic: CriticSection = CriticSection()
    skip_zero_advantage: bool = True
    """Leave samples whose advantage is zero on every token (groups whose rewards are all equal) out of
    the update, as DAPO's dynamic sampling does: their policy gradient is zero, so they only cost time and
    dilute the token mean (with a KL or entropy term, those terms then also skip them)."""


class RewardSection(Section):
    weights: dict[str, float] | None = None
    """Reward components and their weights, for every environment: reward functions computed on an episode's
    final attempt (tests, format, style, efficiency, edge_cases, overlong, examples, `package.module:function`,
    `trl:package.module:function`; see `tempering.rewards`) and the environments' own components (code:
    improvement; tool: success, tool_error; answer / reasoning_gym: correct). Unset = each environment's
    defaults (code: tests 1.0, format 0.1; tool: success 1.0, tool_error -0.1; answer: correct 1.0)."""
    params: dict[str, dict[str, Any]] = {}
    """Keyword arguments per component, e.g. {tests: {edge_weight: 2.0}, overlong: {max_tokens: 48}}."""
    guards: bool = True
    """Penalise attempts caught by a reward-hacking guard (detections are logged either way)."""
    guard_kinds: list[str] | None = None
    """Which guards run (default all: exit_before_tests, harness_tampering, always_equal,
    hardcoded_examples, printed_output)."""
    penalty: float = -1.0
    """Reward of an episode with an attempt caught by a guard, when guards are on."""
    step_fn: str | None = None
    """Process-reward hook `package.module:function(task, steps) -> list[float]`, one score per step (a line
    of code, or a turn), credited at the step's last token."""
    control: Literal["none", "coin"] = "none"
    """A control arm: `coin` replaces each episode's reward by a coin flip, 1 with probability the mean of the
    real rewards scored with it (a step's, or its shard's), else 0 - the same mean and compute, no signal
    about which sample is better. The real components are still computed and logged. (The format-only
    control is `weights: {format: 1.0}`.)"""
