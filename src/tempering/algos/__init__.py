"""Pure math of RL post-training: advantage estimators, policy losses, KL estimators, masked reductions.

Torch only: no models, configs, I/O or Ray. Shapes use B = sequences, T = response tokens, G = group size.
"""

from collections.abc import Callable, Mapping
from typing import TypeVar, cast

from tempering.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    discounted_returns,
    dr_grpo,
    gae,
    group_mean_std,
    grpo,
    grpo_advantages,
    needs_critic,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from tempering.algos.inputs import AdvantageInputs, LossInputs
from tempering.algos.kl import KL_ESTIMATORS, KLController, kl_k1, kl_k2, kl_k3, kl_reward
from tempering.algos.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    clipped_value_loss,
    gspo_loss,
    ppo_clip_loss,
    token_mean,
    vanilla_pg_loss,
)
from tempering.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

F = TypeVar("F", bound=Callable)


def lookup(registry: Mapping[str, F], name: str, what: str) -> F:
    """registry[name], or a ValueError listing the valid names. `pkg.module:function` loads user code."""
    if name in registry:
        return registry[name]
    if ":" in name:
        from tempering.registry import load_callable

        return cast(F, load_callable(name, what))
    raise ValueError(f"unknown {what} '{name}'; valid: {', '.join(registry)} (or 'package.module:function')")


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "KLController",
    "LossInputs",
    "aggregate",
    "cispo_loss",
    "clipped_value_loss",
    "discounted_returns",
    "dr_grpo",
    "gae",
    "group_mean_std",
    "grpo",
    "grpo_advantages",
    "gspo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_reward",
    "lookup",
    "needs_critic",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "token_mean",
    "vanilla_pg_loss",
]
