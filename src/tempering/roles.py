"""The parts of an RL run, built once from its config in one trip down the layers: the estimator and the
policy loss bound to their hyper-parameters (`training.algorithm`), the update's settings, this process's
rollout source, the reference engine, the rollout pool and the data-parallel trainers. `RLTrainer` receives
them built and reads no config to make them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tempering.algos.advantages import AdvantageEstimator
from tempering.algos.losses import PolicyLoss
from tempering.config import RunConfig
from tempering.distributed.canary import Probe
from tempering.distributed.pool import Pool, make_pool
from tempering.distributed.source import RolloutSource
from tempering.inference.chat import chat_format
from tempering.inference.engine import Engine, make_engine
from tempering.sandbox import Sandbox
from tempering.seeding import step_seed
from tempering.state import TrainState
from tempering.training.algorithm import bind_estimator, bind_policy_loss
from tempering.training.update import UpdateSettings
from tempering.types import Task


@dataclass
class Roles:
    """What `RLTrainer` runs on. `trainers`: the data-parallel trainer actors beside this process (rank 0),
    None when it trains alone; `ref`: the reference engine, None without a KL term."""

    estimator: AdvantageEstimator
    policy_loss: PolicyLoss
    update: UpdateSettings
    source: RolloutSource
    ref: Engine | None
    pool: Pool
    trainers: Any = None


def build_roles(
    cfg: RunConfig, state: TrainState, heldout_tasks: list[Task], sandbox: Sandbox, log=print
) -> Roles:
    """Build every part of the run on `state` (a new or a resumed one)."""
    source = RolloutSource(cfg, state.policy, state.tokenizer, sandbox, version=state.step)
    ref = None
    if cfg.algo.kl_coef > 0:
        model, adapters = (
            (state.ref, True) if state.ref is not None else (state.policy, False)
        )  # LoRA: the base
        ref = make_engine(model, state.tokenizer, source.engine.sampling, adapters=adapters)
    pool = make_pool(cfg, source, state.policy, probe(cfg, state, heldout_tasks), log=log)
    pool.publish(state.step, state.policy)
    pool.restore_pending(state.pool_metrics)  # a resumed run's next row: what the checkpoint held back
    trainers = None
    if cfg.distributed.trainers > 1:
        from tempering.distributed.ray_trainers import TrainerGroup

        trainers = TrainerGroup(cfg, state, log=log)
    return Roles(
        bind_estimator(cfg),
        bind_policy_loss(cfg),
        UpdateSettings.from_config(cfg),
        source,
        ref,
        pool,
        trainers,
    )


def probe(cfg: RunConfig, state: TrainState, heldout_tasks: list[Task]) -> Probe:
    """The weight-sync canary's probe: the first held-out prompts and seeded random tokens (the same after a
    resume)."""
    fmt = chat_format(state.tokenizer, cfg.env.chat_format)
    prompts = [fmt.start(t.prompt)[0] for t in heldout_tasks[:4]] or [[0]]
    return Probe.build(prompts, len(state.tokenizer), seed=step_seed(cfg.run.seed, 0, 9))
