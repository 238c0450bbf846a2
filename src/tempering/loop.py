"""The RL loop: collect -> score -> estimate -> update -> sync -> log / checkpoint.

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

from tempering.algos import AdvantageInputs, group_mean_std, kl_reward, masked_whiten
from tempering.algos.correction import rollout_correction
from tempering.config import RunConfig
from tempering.data.tasks import spread_over_domains
from tempering.distributed.schedule import behaviour_version, shard_specs, staleness_metrics
from tempering.errors import Preempted
from tempering.eval.evaluate import validation_metrics
from tempering.inference.engine import SamplingParams
from tempering.roles import Roles
from tempering.rollout.batch import Rollout, RolloutBatch, merge_rollouts
from tempering.seeding import step_generator, step_seed
from tempering.state import TrainState
from tempering.tracking import Timer, Tracker
from tempering.tracking.metrics import rollout_metrics, sample_rows
from tempering.training.update import policy_logprobs, update_models, without_dropout
from tempering.types import Task

__all__ = ["RLTrainer", "StepResult", "step_generator", "step_seed"]


def _add_times(timer: Timer, rollout: Rollout) -> Rollout:
    """The phases a rollout timed where it ran (generation, environments, reward) join the step's."""
    for k, v in rollout.timings.items():
        timer.seconds[k] = timer.seconds.get(k, 0.0) + v
    return rollout


@dataclass
class StepResult:
    """What one step leaves for the log: its metric row and its sample rows."""

    metrics: dict[str, float]
    samples: list[dict] = field(default_factory=list)


class RLTrainer:
    """Runs the remaining steps of a run on a built (or resumed) `TrainState`."""

    def __init__(self, cfg: RunConfig, state: TrainState, heldout_tasks: list[Task], roles: Roles, log=print):
        self.cfg, self.state, self.heldout_tasks, self.log = cfg, state, heldout_tasks, log
        self.roles = roles
        self.source, self.ref, self.pool, self.trainers = roles.source, roles.ref, roles.pool, roles.trainers
        self.engine, self.ctx = self.source.engine, self.source.ctx
        self.submitted: dict[int, object] = {}  # step -> the pool's ticket of its round 0
        self.ready: dict[int, Rollout] = dict(
            state.lookahead
        )  # finished look-ahead batches (a resumed run's too)
        self.stop_signal: str | None = None

    # ------------------------------------------------------------------------------------ one step

    def step(self, step: int) -> StepResult:
        timer = Timer()
        with timer("step"):
            self.submit_ahead(step)
            rollout = self.collect(step, timer)
            batch = rollout.batch
            if len(batch) == 0:  # dynamic sampling found no group with a learning signal
                self.pool.publish(step, self.state.policy)  # the same weights, now those of version `step`
                return StepResult({"actor/trained_fraction": 0.0, **rollout.metrics, **timer.seconds})
            metrics = self.score(batch, timer)
            if self.cfg.algo.correction != "none":
                metrics |= self.correct(batch, timer)
            with timer("adv"):
                self.estimate(batch)
            metrics |= self.update(step, batch, timer)
            self.control_kl(metrics, len(batch))
            with timer("sync"):
                self.pool.publish(step, self.state.policy)
            metrics |= rollout_metrics(rollout.episodes, rollout.rewards, batch) | rollout.metrics
            metrics |= staleness_metrics(step, batch.versions)
            if self.state.monitor is not None:
                self.state.monitor.record(metrics)
            if self.cfg.eval.every and step % self.cfg.eval.every == 0 and step < self.cfg.train.steps:
                with timer("val"):
                    metrics |= self.validate(step)
        metrics |= self.pool.metrics() | timer.seconds
        metrics["perf/tokens_per_s"] = batch.num_tokens() / timer.seconds["timing_s/step"]
        return StepResult(metrics, sample_rows(rollout.episodes, rollout.rewards, batch))

    # ----------------------------------------------------------------------------------- rollouts

    def submit_ahead(self, step: int) -> None:
        """Send the batches of steps `step` .. `step + k` that are not on their way yet, in step order (the
        task sampler's draws stay those of the synchronous loop). The batch of step s goes out when the
        trainer's weights are those of its behaviour version v(s) = max(0, s - 1 - k)."""
        k, last = self.cfg.rollout.max_staleness, self.cfg.train.steps
        for s in range(step, min(step + k, last) + 1):
            if s not in self.submitted and s not in self.ready:
                assert behaviour_version(s, k) == self.engine.version, "a batch sent with the wrong weights"
                self.submitted[s] = self.send_round(s, 0)

    def send_round(self, step: int, round_: int):
        """Draw a round's tasks and send them to the pool as `rollout.shards` shards."""
        ro = self.cfg.rollout
        tasks = self.state.sampler.next_batch(ro.prompts_per_step)
        return self.pool.submit(
            shard_specs(step, round_, tasks, ro.shards, self.cfg.run.seed, self.engine.version)
        )

    def take(self, step: int) -> Rollout:
        """Round 0 of step `step`: finished already (a look-ahead batch), or waited for."""
        if step not in self.ready:
            self.ready[step] = self.pool.gather(self.submitted.pop(step))
        return self.ready.pop(step)

    def lookahead(self, step: int) -> dict[int, Rollout]:
        """The finished batches of the steps after `step` (what a checkpoint at `step` keeps: with them, a
        resumed asynchronous run trains on exactly what an uninterrupted one would)."""
        for s in sorted(self.submitted):
            self.ready[s] = self.pool.gather(self.submitted.pop(s))
        return {s: r for s, r in self.ready.items() if s > step}

    def collect(self, step: int, timer: Timer) -> Rollout:
        """Round 0's episodes; with DAPO's dynamic sampling (synchronous runs), groups whose scores are all
        equal are dropped and more tasks are sampled (at most `max_sampling_rounds` rounds), cut to
        `prompts_per_step` groups."""
        algo, want = self.cfg.algo, self.cfg.rollout.prompts_per_step
        with timer("wait"):
            first = self.take(step)
        _add_times(timer, first)
        if not algo.dynamic_sampling:
            return first
        parts: list[Rollout] = []
        kept = dropped = 0
        for round_ in range(algo.max_sampling_rounds):
            r = first if round_ == 0 else _add_times(timer, self.pool.gather(self.send_round(step, round_)))
            # The full score (an episode's outcome plus its process rewards) decides what is informative.
            _, std, _ = group_mean_std(
                torch.tensor([x.score for x in r.rewards], dtype=torch.float32), r.batch.group_ids
            )
            informative = [i for i in range(len(r.episodes)) if std[i] > 0]
            groups = set(sorted({int(r.batch.group_ids[i]) for i in informative})[: want - kept])
            rows = [i for i in informative if int(r.batch.group_ids[i]) in groups]
            dropped += want - len({int(r.batch.group_ids[i]) for i in informative})
            kept += len(groups)
            parts.append(
                Rollout(
                    [r.episodes[i] for i in rows],
                    [r.rewards[i] for i in rows],
                    r.batch.select(torch.tensor(rows, dtype=torch.long)),
                    r.metrics,
                )
            )
            if kept >= want:
                break
        merged = merge_rollouts([p for p in parts if p.episodes] or parts[:1])
        merged.metrics |= {
            "dapo/kept_groups": kept,
            "dapo/dropped_groups": dropped,
            "dapo/rounds": round_ + 1,
        }
        return merged

    def score(self, batch: RolloutBatch, timer: Timer) -> dict[str, float]:
        """Reference log-probs (and the KL penalty, when KL is in the reward) and critic values."""
        algo, metrics = self.cfg.algo, {}
        if self.ref is not None:
            with timer("ref"):
                batch.ref_logprobs = self.ref.logprobs(
                    batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.attention
                )
            if algo.kl_mode == "reward":
                penalty, kl = kl_reward(
                    batch.old_logprobs,
                    batch.ref_logprobs,
                    batch.response_mask,
                    coef=self.state.kl.coef,
                    estimator=algo.kl_estimator,
                )
                batch.token_rewards = (
                    penalty if batch.token_rewards is None else batch.token_rewards + penalty
                )
                metrics["actor/reward_kl"] = float(kl)
        if self.state.critic is not None:
            with timer("values"), torch.no_grad():
                batch.values = self.state.critic.values(
                    batch.prompt_ids,
                    batch.prompt_mask,
                    batch.response_ids,
                    batch.response_mask,
                    batch.response_attention,
                ).cpu()
        return metrics

    def correct(self, batch: RolloutBatch, timer: Timer) -> dict[str, float]:
        """Decoupled mismatch correction (`algo.correction`): the trainer recomputes pi_old, the PPO ratio's
        denominator; the sampler's log-probs mu stay as `behaviour_logprobs`, and each token (or sequence) is
        weighted by pi_old / mu, truncated (tis), or rejected from the update's loss mask (mis)."""
        algo = self.cfg.algo
        with timer("recompute"):
            old = self.recompute(batch)
        batch.behaviour_logprobs, batch.old_logprobs = batch.old_logprobs, old
        batch.is_weights, batch.kept_mask, metrics = rollout_correction(
            old,
            batch.behaviour_logprobs,
            batch.response_mask,
            mode=algo.correction,
            level=algo.correction_level,
            cap=algo.correction_cap,
        )
        return metrics

    @torch.no_grad()
    def recompute(self, batch: RolloutBatch) -> torch.Tensor:
        """The current policy's log-probs of the batch's response tokens (B, R), as the update computes them."""
        policy, out, settings = self.state.policy, torch.zeros_like(batch.old_logprobs), self.roles.update
        device = next(policy.parameters()).device
        without_dropout(policy)
        try:
            for index in torch.arange(len(batch)).chunk(settings.minibatches):
                mb = batch.select(index).trim().to(device)
                logprobs, _ = policy_logprobs(policy, mb, self.engine.sampling.temperature, settings.compute)
                out[index, : logprobs.shape[1]] = logprobs.float().cpu()
        finally:
            policy.train()
        return out * batch.response_mask

    def estimate(self, batch: RolloutBatch) -> None:
        algo = self.cfg.algo
        x = AdvantageInputs(
            batch.rewards, batch.response_mask, batch.group_ids, batch.values, batch.token_rewards
        )
        batch.advantages, batch.returns = self.roles.estimator(x)
        if algo.whiten_advantages:
            batch.advantages = masked_whiten(batch.advantages, batch.response_mask) * batch.response_mask

    def update(self, step: int, batch: RolloutBatch, timer: Timer) -> dict[str, float]:
        """The critic, then the policy (`training.update.update_models`), on this process and, with
        `distributed.trainers` > 1, on the trainer actors beside it (each a part of every minibatch)."""
        state, lr = self.state, self.state.scheduler.get_last_lr()
        kl_coef = state.kl.coef if self.cfg.algo.kl_mode == "loss" else 0.0

        def here(dp=None):  # this process's update (rank 0 of the data-parallel trainers)
            return update_models(
                self.cfg,
                state,
                batch,
                step,
                loss=self.roles.policy_loss,
                settings=self.roles.update,
                kl_coef=kl_coef,
                timer=timer,
                dp=dp,
            )

        if self.trainers is None:
            metrics = here()
        else:
            metrics = self.trainers.update(step, batch, lr, kl_coef, here, state)
        metrics["actor/lr"] = lr[0]
        state.scheduler.step()
        return metrics

    def control_kl(self, metrics: dict[str, float], samples: int) -> None:
        """Adaptive KL (Ziegler et al.): the step's observed KL moves the coefficient; n = samples in the step."""
        if self.ref is not None:
            metrics["actor/kl_coef"] = self.state.kl.coef
            self.state.kl.update(
                metrics.get("actor/reward_kl", metrics.get("actor/kl_loss", 0.0)), n_steps=samples
            )

    def validate(self, step: int) -> dict[str, float]:
        """Held-out pass@1 on `eval.val_tasks` tasks, domains in turn: sampled (2 per task) and greedy; the domain
        monitor (a mixture run) reads it and may change the mixture's weights for the next steps."""
        cfg, engine = self.cfg, self.engine
        rollout, engine.sampling = (
            engine.sampling,
            SamplingParams(cfg.eval.temperature, 1.0, cfg.rollout.max_new_tokens),
        )
        try:  # the policy's own engine (one cache), at the evaluation's temperature meanwhile
            metrics, per_task = validation_metrics(
                engine,
                spread_over_domains(self.heldout_tasks, cfg.eval.val_tasks),
                self.ctx,
                seed=step_seed(cfg.run.seed, step, 2),
                max_context=cfg.env.max_context,
                chat=cfg.env.chat_format,
            )
        finally:
            engine.sampling = rollout
        monitor = self.state.monitor
        if monitor is not None:
            alerts = monitor.observe(step, per_task)
            for alert in alerts:
                self.log(alert.line())
            metrics |= monitor.metrics(alerts)
        return metrics

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
            if self.trainers is not None:
                self.trainers.close()
            self.pool.close()
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
            out_of_time = (
                cfg.train.max_time_s is not None and time.monotonic() - began >= cfg.train.max_time_s
            )
            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps or out_of_time or self.stop_signal:
                start = time.perf_counter()
                lookahead = self.lookahead(
                    step
                )  # gathered now: the pool's figures of that go in the next row
                state.save(step, cfg.to_yaml(), lookahead=lookahead, pool_metrics=self.pool.pending_metrics())
                pending_checkpoint_s = time.perf_counter() - start
            if self.stop_signal:
                state.saver.close()
                raise Preempted(
                    f"{self.stop_signal}: saved step {step} in {state.saver.root}; run the same "
                    "command again to resume"
                )
            if out_of_time:
                self.log(f"train.max_time_s ({cfg.train.max_time_s:.0f} s) reached after step {step}")
                break
        return step
