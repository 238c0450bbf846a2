"""The run's algorithm: its advantage estimator and policy loss, bound once to the config's hyper-parameters.

A function is bound to those of the run's hyper-parameters it declares (`registry.bind`: a
`functools.partial` after a signature check) and is called later as `fn(x)`. The config's checks
(`config_checks`) bind the same way at load time, so a user function that requires a keyword the run does
not have fails there, in one line, before anything is written.
"""

from __future__ import annotations

from typing import Any

from tempering.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, lookup
from tempering.algos.advantages import AdvantageEstimator
from tempering.algos.losses import PolicyLoss
from tempering.config import RunConfig
from tempering.registry import accepted, bind


def estimator_hyper(cfg: RunConfig) -> dict[str, Any]:
    """The run's estimator hyper-parameters; an estimator is bound to those it declares."""
    a = cfg.algo
    return {"scale_by_std": a.scale_by_std, "gamma": a.gamma, "lam": a.lam}


def loss_hyper(cfg: RunConfig) -> dict[str, Any]:
    """The run's policy-loss hyper-parameters; a loss is bound to those it declares. `norm_length` is the
    longest response an episode can have (seq-mean-token-sum-norm's constant)."""
    a = cfg.algo
    return {
        "clip_ratio": a.clip_ratio,
        "clip_ratio_low": a.clip_ratio_low,
        "clip_ratio_high": a.clip_ratio_high,
        "clip_ratio_c": a.clip_ratio_c,
        "loss_agg": a.loss_agg,
        "norm_length": cfg.rollout.max_new_tokens * cfg.env.max_turns,
    }


def bind_estimator(cfg: RunConfig) -> AdvantageEstimator:
    """`algo.estimator` (a registry name or `package.module:function`), called as `estimator(x)`."""
    fn = lookup(ADVANTAGE_ESTIMATORS, cfg.algo.estimator, "advantage estimator")
    return bind(fn, cfg.algo.estimator, "advantage estimator", **accepted(fn, estimator_hyper(cfg)))


def bind_policy_loss(cfg: RunConfig) -> PolicyLoss:
    """`algo.policy_loss` (a registry name or `package.module:function`), called as `loss(x)`."""
    fn = lookup(POLICY_LOSSES, cfg.algo.policy_loss, "policy loss")
    return bind(fn, cfg.algo.policy_loss, "policy loss", **accepted(fn, loss_hyper(cfg)))
