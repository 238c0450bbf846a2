"""Everything a checkpoint saves, built fresh or resumed from the newest valid checkpoint.

`TrainState.build_or_resume` wires checkpoint storage (local directory, optional `checkpoint.uri` mirror),
loads the policy (and the frozen reference when KL is used, and the critic when the estimator has one),
makes the optimizers and schedule, and restores what the newest checkpoint holds: weights, optimizer,
scheduler, the task sampler's position and the KL coefficient (RNG states are restored by the checkpoint
module). The RL loop gets it ready-made and only calls `save`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tempering import checkpoint as ckpt
from tempering import config_history
from tempering.algos import ADVANTAGE_ESTIMATORS, KLController, lookup, needs_critic
from tempering.config import RunConfig
from tempering.data import MixtureSampler, TaskSampler
from tempering.eval.monitor import DomainMonitor
from tempering.models.loading import load_model, load_tokenizer
from tempering.models.lora import add_adapters
from tempering.training.critic import Critic
from tempering.training.optim import make_optimizer, make_scheduler
from tempering.types import Task

LOOKAHEAD = "lookahead.pt"


@dataclass
class Resume:
    """Where a run resumes: its checkpoint mirror, the newest valid checkpoint (None: a fresh start), and the
    config change that checkpoint brings (allowed by --allow-config-change), still to be recorded."""

    remote: ckpt.RemoteStore | None
    checkpoint: ckpt.Checkpoint | None
    change: config_history.ConfigChange | None = None

    def record(self, run_dir: Path, allow_config_change: bool, log=print) -> None:
        if self.change is not None:
            config_history.record(run_dir, self.change, allow_config_change)
            log(
                f"config differs from checkpoint {self.checkpoint.path.name} (accepted with "
                f"--allow-config-change): {self.change.describe(self.change.forced)}"
            )


def find_resume(
    cfg: RunConfig, run_dir: Path, *, allow_config_change: bool = False, vetted: str | None = None, log=print
) -> Resume:
    """The newest valid checkpoint, local or from `checkpoint.uri` (downloaded into the run directory);
    partial or corrupt ones are named in the log and skipped. Its config is checked against `cfg`
    (`config_history.check_checkpoint`; `vetted`: the config `check_resume` compared `cfg` with, not yet
    recorded): a refusal raises ConfigError. Nothing else in the run directory is written."""
    c = cfg.checkpoint
    remote = (
        ckpt.RemoteStore(c.uri, c.storage, retries=c.upload_retries, backoff_s=c.retry_backoff_s, log=log)
        if c.uri
        else None
    )
    latest = ckpt.resume_point(run_dir / "checkpoints", remote, log)
    change = None
    if latest is not None:  # e.g. a checkpoint from `checkpoint.uri`, saved under another config
        change = config_history.check_checkpoint(
            run_dir, latest.path, cfg, allow_config_change, vetted=vetted
        )
    return Resume(remote, latest, change)


@dataclass
class TrainState:
    policy: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    sampler: TaskSampler | MixtureSampler
    kl: KLController
    saver: ckpt.Saver
    ref: torch.nn.Module | None = None
    """The frozen start model, when `algo.kl_coef` > 0 (with LoRA: None, the policy's base is the reference)."""
    critic: Critic | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    step: int = 0
    """The last completed step (0 = a fresh run)."""
    lookahead: dict = field(default_factory=dict)
    """Asynchronous rollouts: step -> the finished batch (a `Rollout`) of each step after `step` that was
    sampled before the checkpoint (`rollout.max_staleness` of them); restored so a resumed run trains on
    exactly what an uninterrupted one would."""
    pool_metrics: dict[str, float] = field(default_factory=dict)
    """The rollout pool's figures not yet in a row when the checkpoint was taken (gathering the look-ahead
    batches checks the weight sync: `sync/canary_max_abs_diff`); the next row reports them, resumed or not."""
    monitor: DomainMonitor | None = None
    """A mixture run with periodic validation: the domain monitor that sets the mixture's weights."""

    @classmethod
    def build_or_resume(
        cls,
        cfg: RunConfig,
        run_dir: Path,
        train_tasks: list[Task],
        start_model_dir: Path,
        *,
        resume: Resume | None = None,
        allow_config_change: bool = False,
        log=print,
    ) -> TrainState:
        """`resume`: where to resume, as `find_resume` found it (`workspace.prepare`, before it wrote anything);
        None: looked up here, and a config change its checkpoint brings recorded."""
        algo, c = cfg.algo, cfg.checkpoint
        if resume is None:
            resume = find_resume(cfg, run_dir, allow_config_change=allow_config_change, log=log)
            resume.record(run_dir, allow_config_change, log)
        remote, latest, checkpoints = resume.remote, resume.checkpoint, run_dir / "checkpoints"
        saver = ckpt.Saver(
            checkpoints,
            keep=c.keep,
            keep_every=c.keep_every,
            remote=remote,
            asynchronous=c.async_save,
            log=log,
        )
        model_dir = latest.model_dir if latest else start_model_dir
        policy = load_policy(cfg, start_model_dir, model_dir)
        optimizer = make_optimizer(policy, lr=algo.lr, weight_decay=algo.weight_decay)
        state = cls(
            policy=policy,
            tokenizer=load_tokenizer(model_dir),
            optimizer=optimizer,
            scheduler=make_scheduler(optimizer, warmup_steps=algo.warmup_steps, total_steps=cfg.train.steps),
            sampler=MixtureSampler(train_tasks, cfg.data.mixture, cfg.run.seed)
            if cfg.data.mixture
            else TaskSampler(train_tasks, seed=cfg.run.seed),
            kl=KLController(algo.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon),
            saver=saver,
        )
        if algo.kl_coef > 0 and not cfg.model.lora.r:
            state.ref = load_model(start_model_dir, dtype=cfg.model.dtype, device=cfg.run.device).eval()
            state.ref.requires_grad_(False)
        if needs_critic(lookup(ADVANTAGE_ESTIMATORS, algo.estimator, "advantage estimator")):
            critic_dir = latest.path / "critic" if latest else start_model_dir
            state.critic = Critic.from_pretrained(critic_dir, dtype=cfg.model.dtype, device=cfg.run.device)
            state.critic_optimizer = make_optimizer(state.critic, lr=algo.critic.lr)
        if isinstance(state.sampler, MixtureSampler) and cfg.eval.every:
            state.monitor = DomainMonitor(state.sampler, cfg.eval.monitor_boost)
        if latest is not None:
            saved = latest.load_into(state.optimizer, state.scheduler)
            state.sampler.load_state_dict(saved["sampler"])
            if state.monitor is not None:
                state.monitor.load_state_dict(saved.get("monitor", {}))
            if "kl" in saved:
                state.kl.load_state_dict(saved["kl"])
            if state.critic_optimizer is not None:
                state.critic_optimizer.load_state_dict(
                    torch.load(
                        latest.path / "critic" / "optimizer.pt", map_location="cpu", weights_only=False
                    )
                )
            state.step = latest.step
            state.pool_metrics = saved.get("pool_metrics", {})
            if (latest.path / LOOKAHEAD).is_file():
                state.lookahead = torch.load(latest.path / LOOKAHEAD, map_location="cpu", weights_only=False)
            log(f"resuming from {latest.path.name}")
        return state

    def save(
        self,
        step: int,
        config_yaml: str,
        lookahead: dict | None = None,
        pool_metrics: dict[str, float] | None = None,
    ) -> None:
        """Snapshot the state now (CPU copies); the saver writes (and uploads) it while training goes on.
        `lookahead`: the finished batches of later steps (asynchronous rollouts), saved with it;
        `pool_metrics`: the pool's figures that the next row reports."""
        writers = []
        if self.critic is not None:
            critic, optimizer = self.critic, copy.deepcopy(self.critic_optimizer.state_dict())
            backbone, head = (
                ckpt.cpu_copy(critic.backbone.state_dict()),
                ckpt.cpu_copy(critic.head.state_dict()),
            )

            def write_critic(directory: Path) -> None:
                critic.save_snapshot(directory / "critic", backbone, head)
                torch.save(optimizer, directory / "critic" / "optimizer.pt")

            writers.append(write_critic)
        if lookahead:
            later = copy.deepcopy(lookahead)  # the next steps train on these while the saver writes
            writers.append(lambda directory: torch.save(later, directory / LOOKAHEAD))

        def extra(directory: Path) -> None:
            for write in writers:
                write(directory)

        self.saver.save(
            ckpt.snapshot(
                step,
                model=self.policy,
                tokenizer=self.tokenizer,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                trainer_state={
                    "sampler": self.sampler.state_dict(),
                    "kl": self.kl.state_dict(),
                    **({"monitor": self.monitor.state_dict()} if self.monitor is not None else {}),
                    **({"pool_metrics": dict(pool_metrics)} if pool_metrics else {}),
                },
                config_yaml=config_yaml,
                extra=extra if writers else None,
            )
        )


def load_policy(cfg: RunConfig, start_model_dir: Path, model_dir: Path) -> torch.nn.Module:
    """The policy to train: the start model (fresh adapters on it, with LoRA), or a checkpoint's model (its
    adapters, with LoRA)."""
    m = cfg.model
    if m.lora.r and model_dir != start_model_dir:  # a LoRA checkpoint holds only the adapters
        policy = load_model(model_dir, dtype=m.dtype, device=cfg.run.device, trainable_adapters=True)
    else:
        policy = load_model(model_dir, dtype=m.dtype, device=cfg.run.device)
        if m.lora.r:
            policy = add_adapters(
                policy,
                start_model_dir,
                r=m.lora.r,
                alpha=m.lora.alpha,
                dropout=m.lora.dropout,
                target_modules=m.lora.target_modules,
                seed=cfg.run.seed,
            )
    return policy
