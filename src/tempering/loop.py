"""The RL loop (DESIGN.md, "The loop"): collect -> score -> estimate -> update -> sync -> log / checkpoint.

One path: every task is an episode of its environment (a single-turn code task is a one-turn episode of
the code environment), sampled by a rollout engine that owns the sampling distribution. Every random
choice of step s comes from generators seeded by (run seed, s), and all other state that shapes later
steps (weights, optimizer, scheduler, sampler position, KL coefficient) is in each checkpoint, so a run
resumed from checkpoint k writes the same metrics rows as one that never stopped.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from tempering.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    group_mean_std,
    lookup,
    masked_mean,
    masked_whiten,
)
from tempering.config import RunConfig
from tempering.envs import env_context
from tempering.errors import Preempted
from tempering.eval.evaluate import validation_metrics
from tempering.models.loading import compute_dtype
from tempering.rewards import RewardFunction
from tempering.rollout.batch import RolloutBatch, collate, concat_batches
from tempering.rollout.engine import SamplingParams, make_engine
from tempering.rollout.episodes import Rollout, run_episodes
from tempering.sandbox import Sandbox
from tempering.state import TrainState
from tempering.tracking import Timer, Tracker
from tempering.tracking.metrics import rollout_metrics, sample_rows
from tempering.training.critic import update_critic
from tempering.training.update import update_policy
from tempering.types import Task


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """The seed of one purpose (stream) of one step, independent of everything that ran before."""
    return (seed * 1_000_003 + step) * 16 + stream


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(step_seed(seed, step, stream))


@dataclass
class StepResult:
    """What one step leaves for the log: its metric row and its sample rows."""

    metrics: dict[str, float]
    samples: list[dict] = field(default_factory=list)


class RLTrainer:
    """Runs the remaining steps of a run on a built (or resumed) `TrainState`."""

    def __init__(self, cfg: RunConfig, state: TrainState, heldout_tasks: list[Task], sandbox: Sandbox, log=print):
        self.cfg, self.state, self.heldout_tasks, self.log = cfg, state, heldout_tasks, log
        algo, r = cfg.algo, cfg.reward
        self.estimator = lookup(ADVANTAGE_ESTIMATORS, algo.estimator, "advantage estimator")
        self.policy_loss = lookup(POLICY_LOSSES, algo.policy_loss, "policy loss")
        self.reward_fn = RewardFunction(r.weights, params=r.params, guards=r.guards, guard_kinds=r.guard_kinds,
                                        penalty=r.penalty, step_fn=r.step_fn)
        self.ctx = env_context(cfg, sandbox, self.reward_fn.needs)
        sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens)
        lora = cfg.model.lora
        vllm = {"lora_scaling": lora.alpha / lora.r if lora.r else None} if cfg.rollout.engine == "vllm" else {}
        self.compute = compute_dtype(cfg.model.compute, cfg.run.device)
        self.engine = make_engine(state.policy, state.tokenizer, sampling, kind=cfg.rollout.engine, version=state.step,
                                  dtype=self.compute, **vllm)
        ref, adapters = (state.ref, True) if state.ref is not None else (state.policy, False)  # LoRA: the base
        self.ref = make_engine(ref, state.tokenizer, sampling, adapters=adapters) if algo.kl_coef > 0 else None
        self.stop_signal: str | None = None

    # ------------------------------------------------------------------------------------ one step

    def step(self, step: int) -> StepResult:
        timer = Timer()
        with timer("step"):
            rollout = self.collect(step, timer)
            batch = rollout.batch
            if len(batch) == 0:  # dynamic sampling found no group with a learning signal
                return StepResult({"actor/trained_fraction": 0.0, **rollout.metrics, **timer.seconds})
            metrics = self.score(batch, timer)
            with timer("adv"):
                self.estimate(batch)
            metrics |= self.update(step, batch, timer)
            self.control_kl(metrics, len(batch))
            with timer("sync"):
                self.engine.load_weights(self.state.policy.state_dict(), version=step)
            metrics |= rollout_metrics(rollout.episodes, rollout.rewards, batch) | rollout.metrics
            if self.cfg.eval.every and step % self.cfg.eval.every == 0 and step < self.cfg.train.steps:
                with timer("val"):
                    metrics |= self.validate(step)
        metrics |= timer.seconds
        metrics["perf/tokens_per_s"] = batch.num_tokens() / timer.seconds["timing_s/step"]
        return StepResult(metrics, sample_rows(rollout.episodes, rollout.rewards, batch))

    def sample_round(self, step: int, round_: int, timer: Timer) -> Rollout:
        """`prompts_per_step` tasks x `group_size` episodes, run, rewarded and collated."""
        ro, seed = self.cfg.rollout, self.cfg.run.seed
        tasks = self.state.sampler.next_batch(ro.prompts_per_step)
        episodes = run_episodes(self.engine, tasks, self.ctx, group_size=ro.group_size,
                                max_context=self.cfg.env.max_context, chat=self.cfg.env.chat_format, timer=timer,
                                generator=step_generator(seed, step, 0 if round_ == 0 else 10 + round_),
                                seed=step_seed(seed, step, 4 + round_))
        with timer("reward"):
            rewards = self.reward_fn.score(episodes)
        batch = collate(episodes, rewards, self.state.tokenizer, group_offset=round_ * ro.prompts_per_step)
        return Rollout(episodes, rewards, batch)

    def collect(self, step: int, timer: Timer) -> Rollout:
        """One round of episodes; with DAPO's dynamic sampling, groups whose scores are all equal are dropped
        and more tasks are sampled (at most `max_sampling_rounds` rounds), cut to `prompts_per_step` groups."""
        algo, want = self.cfg.algo, self.cfg.rollout.prompts_per_step
        if not algo.dynamic_sampling:
            return self.sample_round(step, 0, timer)
        parts: list[Rollout] = []
        kept = dropped = 0
        for round_ in range(algo.max_sampling_rounds):
            r = self.sample_round(step, round_, timer)
            # The full score (an episode's outcome plus its process rewards) decides what is informative.
            _, std, _ = group_mean_std(torch.tensor([x.score for x in r.rewards], dtype=torch.float32),
                                       r.batch.group_ids)
            informative = [i for i in range(len(r.episodes)) if std[i] > 0]
            groups = set(sorted({int(r.batch.group_ids[i]) for i in informative})[: want - kept])
            rows = [i for i in informative if int(r.batch.group_ids[i]) in groups]
            dropped += want - len({int(r.batch.group_ids[i]) for i in informative})
            kept += len(groups)
            parts.append(Rollout([r.episodes[i] for i in rows], [r.rewards[i] for i in rows],
                                 r.batch.select(torch.tensor(rows, dtype=torch.long))))
            if kept >= want:
                break
        parts = [p for p in parts if p.episodes] or parts[:1]
        return Rollout([e for p in parts for e in p.episodes], [x for p in parts for x in p.rewards],
                       concat_batches([p.batch for p in parts]),
                       {"dapo/kept_groups": kept, "dapo/dropped_groups": dropped, "dapo/rounds": round_ + 1})

    def score(self, batch: RolloutBatch, timer: Timer) -> dict[str, float]:
        """Reference log-probs (and the KL penalty, when KL is in the reward) and critic values."""
        algo, metrics = self.cfg.algo, {}
        if self.ref is not None:
            with timer("ref"):
                batch.ref_logprobs = self.ref.logprobs(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                                       batch.attention)
            if algo.kl_mode == "reward":
                kl = KL_ESTIMATORS[algo.kl_estimator](batch.old_logprobs, batch.ref_logprobs) * batch.response_mask
                penalty = -self.state.kl.coef * kl
                batch.token_rewards = penalty if batch.token_rewards is None else batch.token_rewards + penalty
                metrics["actor/reward_kl"] = float(masked_mean(kl, batch.response_mask))
        if self.state.critic is not None:
            with timer("values"), torch.no_grad():
                batch.values = self.state.critic.values(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                                        batch.response_mask, batch.response_attention).cpu()
        return metrics

    def estimate(self, batch: RolloutBatch) -> None:
        algo = self.cfg.algo
        x = AdvantageInputs(batch.rewards, batch.response_mask, batch.group_ids, batch.values, batch.token_rewards)
        batch.advantages, batch.returns = self.estimator(x, scale_by_std=algo.scale_by_std, gamma=algo.gamma, lam=algo.lam)
        if algo.whiten_advantages:
            batch.advantages = masked_whiten(batch.advantages, batch.response_mask) * batch.response_mask

    def update(self, step: int, batch: RolloutBatch, timer: Timer) -> dict[str, float]:
        """The critic on the returns, then PPO epochs of the policy (after the critic's warm-up); KL control."""
        cfg, algo, state, metrics = self.cfg, self.cfg.algo, self.state, {}
        if state.critic is not None:
            with timer("critic"), self.autocast():
                metrics |= update_critic(state.critic, state.critic_optimizer, batch,
                                         generator=step_generator(cfg.run.seed, step, 3), epochs=algo.critic.epochs,
                                         minibatches=algo.minibatches, clip_range=algo.critic.value_clip,
                                         max_grad_norm=algo.max_grad_norm)
        with timer("update"), self.autocast():
            train_batch = batch.informative() if algo.skip_zero_advantage else batch
            if state.critic is None or step > algo.critic.warmup_steps:
                metrics |= update_policy(
                    state.policy, state.optimizer, train_batch, policy_loss=self.policy_loss,
                    generator=step_generator(cfg.run.seed, step, 1), ppo_epochs=algo.ppo_epochs,
                    minibatches=algo.minibatches, clip_ratio=algo.clip_ratio, clip_ratio_low=algo.clip_ratio_low,
                    clip_ratio_high=algo.clip_ratio_high, clip_ratio_c=algo.clip_ratio_c, loss_agg=algo.loss_agg,
                    norm_length=cfg.rollout.max_new_tokens * cfg.env.max_turns,
                    kl_coef=state.kl.coef if algo.kl_mode == "loss" else 0.0, kl_estimator=algo.kl_estimator,
                    entropy_coef=algo.entropy_coef, max_grad_norm=algo.max_grad_norm,
                    temperature=self.engine.sampling.temperature,
                    gradient_checkpointing=cfg.model.gradient_checkpointing)
            metrics["actor/lr"] = state.scheduler.get_last_lr()[0]
            state.scheduler.step()
        metrics["actor/trained_fraction"] = len(train_batch) / len(batch)
        return metrics

    def autocast(self):
        """Mixed precision for the update (`model.compute: bfloat16`): matmuls in bf16, parameters, optimizer
        state and the log-softmax in fp32."""
        device = self.cfg.run.device.split(":")[0]
        return torch.autocast(device, dtype=self.compute, enabled=self.compute != torch.float32)

    def control_kl(self, metrics: dict[str, float], samples: int) -> None:
        """Adaptive KL (Ziegler et al.): the step's observed KL moves the coefficient; n = samples in the step."""
        if self.ref is not None:
            metrics["actor/kl_coef"] = self.state.kl.coef
            self.state.kl.update(metrics.get("actor/reward_kl", metrics.get("actor/kl_loss", 0.0)), n_steps=samples)

    def validate(self, step: int) -> dict[str, float]:
        """Held-out pass@1 on the first `eval.val_tasks` tasks: sampled (2 per task) and greedy."""
        cfg, engine = self.cfg, self.engine
        rollout, engine.sampling = engine.sampling, SamplingParams(cfg.eval.temperature, 1.0, cfg.rollout.max_new_tokens)
        try:  # the policy's own engine (one cache), at the evaluation's temperature meanwhile
            return validation_metrics(engine, self.heldout_tasks[: cfg.eval.val_tasks], self.ctx,
                                      seed=step_seed(cfg.run.seed, step, 2), max_context=cfg.env.max_context,
                                      chat=cfg.env.chat_format)
        finally:
            engine.sampling = rollout

    # ---------------------------------------------------------------------------------- the loop

    def run(self, tracker: Tracker) -> int:
        """Run the remaining steps (or until `train.max_time_s` has passed); returns the last step run.

        SIGTERM (a preemptible machine going away) ends the current step, saves, waits for the save and
        raises `Preempted`; running the same command again resumes."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if main else None
        try:
            return self._run(tracker)
        finally:
            self.state.saver.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_signal = "SIGTERM"

    def _run(self, tracker: Tracker) -> int:
        cfg, state = self.cfg, self.state
        pending_checkpoint_s, began, step = 0.0, time.monotonic(), state.step
        for step in range(state.step + 1, cfg.train.steps + 1):
            result = self.step(step)
            metrics = result.metrics
            # A save happens after its step's row is written (so a crash can never lose a row that a
            # checkpoint already covers); its duration is reported in the next row.
            if pending_checkpoint_s:
                metrics["timing_s/checkpoint"], pending_checkpoint_s = pending_checkpoint_s, 0.0
            tracker.log(step, metrics)
            if cfg.tracking.samples_every and step % cfg.tracking.samples_every == 0:
                tracker.write_samples(step, result.samples)
            out_of_time = cfg.train.max_time_s is not None and time.monotonic() - began >= cfg.train.max_time_s
            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps or out_of_time or self.stop_signal:
                start = time.perf_counter()
                state.save(step, cfg.to_yaml())
                pending_checkpoint_s = time.perf_counter() - start
            if self.stop_signal:
                state.saver.close()
                raise Preempted(f"{self.stop_signal}: saved step {step} in {state.saver.root}; run the same "
                                "command again to resume")
            if out_of_time:
                self.log(f"train.max_time_s ({cfg.train.max_time_s:.0f} s) reached after step {step}")
                break
        return step
