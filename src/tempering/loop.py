"""The RL loop (DESIGN.md, "The loop"): sample, execute, reward, estimate advantages, update, checkpoint.

Every random choice of step s comes from generators seeded by (run seed, s), and all other state that
shapes later steps (weights, optimizer, scheduler, sampler position, global RNGs) is in each checkpoint,
so a run resumed from checkpoint k writes the same metrics rows as one that never stopped.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tempering import checkpoint as ckpt
from tempering.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, lookup
from tempering.config import RunConfig
from tempering.data import TaskSampler
from tempering.eval.evaluate import evaluate
from tempering.models.loading import load_model, load_tokenizer
from tempering.rewards import RewardFunction
from tempering.rollout.batch import RolloutBatch
from tempering.rollout.code import execute, sample
from tempering.rollout.generate import Generation
from tempering.sandbox import Sandbox
from tempering.tracking import Tracker
from tempering.training.forward import response_logprobs
from tempering.training.optim import make_optimizer, make_scheduler
from tempering.training.update import update_policy
from tempering.types import EXEC_STATUSES, RewardResult, Task, Trajectory


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """The seed of one purpose (stream) of one step, independent of everything that ran before."""
    return (seed * 1_000_003 + step) * 16 + stream


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(step_seed(seed, step, stream))


@dataclass
class Timer:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{name}"] = self.seconds.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def collate(gen: Generation, trajectories: list[Trajectory], rewards: list[RewardResult]) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=gen.prompt_ids,
        prompt_mask=gen.prompt_mask,
        response_ids=gen.response_ids,
        response_mask=gen.response_mask,
        old_logprobs=gen.logprobs,
        rewards=torch.tensor([r.score for r in rewards], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories]),
    )


def rollout_metrics(trajectories: list[Trajectory], rewards: list[RewardResult], batch: RolloutBatch,
                    truncated: torch.Tensor) -> dict[str, float]:
    scores = batch.rewards
    m = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "train/pass_rate": sum(t.exec_result.all_passed for t in trajectories) / len(trajectories),
        "response_length/mean": float(batch.response_mask.sum(1).mean()),
        "response_length/clip_ratio": float(truncated.float().mean()),
        "num_turns/mean": 1.0,
        "critic/advantages/mean": float((batch.advantages * batch.response_mask).sum() / batch.response_mask.sum()),
    }
    for name in rewards[0].components:
        m[f"reward/{name}/mean"] = sum(r.components[name] for r in rewards) / len(rewards)
    statuses = Counter(t.exec_result.status for t in trajectories)
    for status in EXEC_STATUSES:
        if statuses[status]:
            m[f"sandbox/status/{status}"] = statuses[status] / len(trajectories)
    return m


def sample_rows(trajectories: list[Trajectory], rewards: list[RewardResult], batch: RolloutBatch) -> list[dict]:
    rows = []
    for i, (traj, reward) in enumerate(zip(trajectories, rewards)):
        rows.append({
            "task_id": traj.task.id, "domain": traj.task.domain, "group": traj.group_id,
            "prompt": traj.task.prompt, "completion": traj.completion, "truncated": traj.truncated,
            "status": traj.exec_result.status, "tests_passed": traj.exec_result.passed_fraction,
            "reward": reward.score, "components": reward.components,
            "advantage": float(batch.advantages[i, 0]) if batch.response_mask[i, 0] else 0.0,
        })
    return rows


class RLTrainer:
    """Holds the policy and everything a checkpoint saves; `run` executes the remaining steps."""

    def __init__(self, cfg: RunConfig, run_dir: Path, train_tasks: list[Task], heldout_tasks: list[Task],
                 start_model_dir: Path, log=print):
        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.heldout_tasks = heldout_tasks
        self.estimator = lookup(ADVANTAGE_ESTIMATORS, cfg.algo.estimator, "advantage estimator")
        self.policy_loss = lookup(POLICY_LOSSES, cfg.algo.policy_loss, "policy loss")
        self.reward_fn = RewardFunction(cfg.reward.weights)
        self.checkpoints = run_dir / "checkpoints"
        latest, skipped = ckpt.find_latest(self.checkpoints)
        for note in skipped:
            log(f"[yellow]{note}[/]")
        model_dir = latest.model_dir if latest else start_model_dir
        self.policy = load_model(model_dir, dtype=cfg.model.dtype, device=cfg.run.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.ref = None
        if cfg.algo.kl_coef > 0:
            self.ref = load_model(start_model_dir, dtype=cfg.model.dtype, device=cfg.run.device).eval()
            self.ref.requires_grad_(False)
        self.optimizer = make_optimizer(self.policy, lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, warmup_steps=cfg.algo.warmup_steps,
                                        total_steps=cfg.train.steps)
        self.sampler = TaskSampler(train_tasks, seed=cfg.run.seed)
        self.start_step = 0
        if latest is not None:
            state = latest.load_into(self.optimizer, self.scheduler)
            self.sampler.load_state_dict(state["sampler"])
            self.start_step = latest.step
            log(f"resuming from {latest.path.name}")

    # ------------------------------------------------------------------------------------ one step

    def step(self, step: int, sandbox: Sandbox) -> tuple[dict[str, float], list[dict]]:
        cfg, ro = self.cfg, self.cfg.rollout
        timer = Timer()
        with timer("step"):
            with timer("gen"):
                tasks = self.sampler.next_batch(ro.prompts_per_step)
                trajectories, gen = sample(
                    self.policy, self.tokenizer, tasks, group_size=ro.group_size, max_new_tokens=ro.max_new_tokens,
                    temperature=ro.temperature, top_p=ro.top_p, generator=step_generator(cfg.run.seed, step, 0),
                )
            with timer("reward"):
                execute(trajectories, sandbox)
                rewards = [self.reward_fn(t.task, t) for t in trajectories]
            batch = collate(gen, trajectories, rewards)
            if self.ref is not None:
                with timer("ref"), torch.no_grad():
                    batch.ref_logprobs, _ = response_logprobs(
                        self.ref, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                        temperature=ro.temperature)
            with timer("adv"):
                batch.advantages, batch.returns = self.estimator(
                    batch.rewards, batch.response_mask, batch.group_ids, values=batch.values,
                    scale_by_std=cfg.algo.scale_by_std,
                )
            with timer("update"):
                train_batch = batch.informative() if cfg.algo.skip_zero_advantage else batch
                metrics = update_policy(
                    self.policy, self.optimizer, train_batch, policy_loss=self.policy_loss,
                    generator=step_generator(cfg.run.seed, step, 1), ppo_epochs=cfg.algo.ppo_epochs,
                    minibatches=cfg.algo.minibatches, clip_ratio=cfg.algo.clip_ratio, loss_agg=cfg.algo.loss_agg,
                    kl_coef=cfg.algo.kl_coef, entropy_coef=cfg.algo.entropy_coef,
                    max_grad_norm=cfg.algo.max_grad_norm, temperature=ro.temperature,
                )
                metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
            metrics.update(rollout_metrics(trajectories, rewards, batch, gen.truncated))
            metrics["actor/trained_fraction"] = len(train_batch) / len(batch)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                with timer("val"):
                    metrics.update(self.validate(step, sandbox))
        metrics.update(timer.seconds)
        metrics["perf/tokens_per_s"] = batch.num_tokens() / timer.seconds["timing_s/step"]
        return metrics, sample_rows(trajectories, rewards, batch)

    def validate(self, step: int, sandbox: Sandbox) -> dict[str, float]:
        """Held-out pass@1 on the first `eval.val_tasks` tasks: sampled (2 per task) and greedy."""
        tasks = self.heldout_tasks[: self.cfg.eval.val_tasks]
        seed = step_seed(self.cfg.run.seed, step, 2)
        sampled = evaluate(self.policy, self.tokenizer, tasks, sandbox, samples=2,
                           temperature=self.cfg.eval.temperature, max_new_tokens=self.cfg.rollout.max_new_tokens,
                           seed=seed)
        greedy = evaluate(self.policy, self.tokenizer, tasks, sandbox, greedy=True,
                          max_new_tokens=self.cfg.rollout.max_new_tokens)
        m = {"val/pass@1": sampled.overall["pass@1"], "val/greedy_pass@1": greedy.overall["pass@1"]}
        for domain, scores in sampled.per_domain.items():
            m[f"val/{domain}/pass@1"] = scores["pass@1"]
        return m

    # ---------------------------------------------------------------------------------- the loop

    def run(self, sandbox: Sandbox, tracker: Tracker) -> None:
        cfg = self.cfg
        pending_checkpoint_s = 0.0
        for step in range(self.start_step + 1, cfg.train.steps + 1):
            metrics, rows = self.step(step, sandbox)
            # A save happens after its step's row is written (so a crash can never lose a row that a
            # checkpoint already covers); its duration is reported in the next row.
            if pending_checkpoint_s:
                metrics["timing_s/checkpoint"] = pending_checkpoint_s
                pending_checkpoint_s = 0.0
            tracker.log(step, metrics)
            if cfg.tracking.samples_every and step % cfg.tracking.samples_every == 0:
                tracker.write_samples(step, rows)
            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
                start = time.perf_counter()
                self.save(step)
                pending_checkpoint_s = time.perf_counter() - start

    def save(self, step: int) -> ckpt.Checkpoint:
        return ckpt.save_checkpoint(
            self.checkpoints, step, model=self.policy, tokenizer=self.tokenizer, optimizer=self.optimizer,
            scheduler=self.scheduler, trainer_state={"sampler": self.sampler.state_dict()},
            config_yaml=self.cfg.to_yaml(), keep=self.cfg.checkpoint.keep,
        )
