"""The RL loop (DESIGN.md, "The loop"): sample, execute, reward, estimate advantages, update, checkpoint.

Every random choice of step s comes from generators seeded by (run seed, s), and all other state that
shapes later steps (weights, optimizer, scheduler, sampler position, global RNGs) is in each checkpoint,
so a run resumed from checkpoint k writes the same metrics rows as one that never stopped.
"""

from __future__ import annotations

import copy
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tempering import checkpoint as ckpt
from tempering import config_history
from tempering.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    NEEDS_CRITIC,
    POLICY_LOSSES,
    KLController,
    group_mean_std,
    lookup,
    masked_mean,
    masked_whiten,
)
from tempering.config import RunConfig
from tempering.data import MixtureSampler, TaskSampler
from tempering.envs import EnvContext
from tempering.errors import Preempted
from tempering.eval.evaluate import evaluate, evaluate_episodes
from tempering.models.loading import load_model, load_tokenizer
from tempering.rewards import RewardFunction
from tempering.rollout.batch import RolloutBatch, concat_batches
from tempering.rollout.code import execute, sample
from tempering.rollout.episodes import collate_episodes, episode_rewards, run_episodes
from tempering.rollout.generate import Generation
from tempering.sandbox import Sandbox
from tempering.tracking import Tracker
from tempering.tracking.metrics import episode_metrics, episode_rows, rollout_metrics, sample_rows
from tempering.training.critic import Critic, update_critic
from tempering.training.forward import response_logprobs
from tempering.training.optim import make_optimizer, make_scheduler
from tempering.training.update import update_policy
from tempering.types import RewardResult, Task, Trajectory


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


def collate(gen: Generation, trajectories: list[Trajectory], rewards: list[RewardResult],
            group_offset: int = 0, tokenizer=None) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=gen.prompt_ids,
        prompt_mask=gen.prompt_mask,
        response_ids=gen.response_ids,
        response_mask=gen.response_mask,
        old_logprobs=gen.logprobs,
        rewards=torch.tensor([r.score for r in rewards], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id + group_offset for t in trajectories]),
        token_rewards=step_token_rewards(gen, rewards, tokenizer),
    )


def step_token_rewards(gen: Generation, rewards: list[RewardResult], tokenizer):
    """Per-step process rewards (`reward.step_fn`) placed at the last token of each step (line). None if unused."""
    if not rewards or "step_rewards" not in rewards[0].info:
        return None
    out = torch.zeros_like(gen.response_mask)
    for i, reward in enumerate(rewards):
        n = int(gen.response_mask[i].sum())
        if n == 0:
            continue
        pieces = [tokenizer.decode([t]) for t in gen.response_ids[i, :n].tolist()]
        for end, value in zip(line_end_tokens(pieces), reward.info["step_rewards"]):
            out[i, end] += value
    return out


def line_end_tokens(pieces: list[str]) -> list[int]:
    """For the tokens spelling a text: the index of the token that ends each of its lines (the last token
    ends the last line, newline or not) - the steps of `rewards.step_texts`."""
    ends = [i for i, piece in enumerate(pieces) for _ in range(piece.count("\n"))]
    if pieces and (not ends or ends[-1] != len(pieces) - 1):
        ends.append(len(pieces) - 1)
    return ends


class RLTrainer:
    """Holds the policy and everything a checkpoint saves; `run` executes the remaining steps."""

    def __init__(self, cfg: RunConfig, run_dir: Path, train_tasks: list[Task], heldout_tasks: list[Task],
                 start_model_dir: Path, log=print, allow_config_change: bool = False):
        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        algo = cfg.algo
        self.heldout_tasks = heldout_tasks
        self.estimator = lookup(ADVANTAGE_ESTIMATORS, algo.estimator, "advantage estimator")
        self.policy_loss = lookup(POLICY_LOSSES, algo.policy_loss, "policy loss")
        r = cfg.reward
        self.reward_fn = RewardFunction(r.weights, params=r.params, guards=r.guards, guard_kinds=r.guard_kinds,
                                        penalty=r.penalty, step_fn=r.step_fn)
        self.reference_cpu: dict[str, float] = {}
        self.checkpoints = run_dir / "checkpoints"
        c = cfg.checkpoint
        remote = ckpt.RemoteStore(c.uri, c.storage, retries=c.upload_retries, backoff_s=c.retry_backoff_s,
                                  log=log) if c.uri else None
        latest = ckpt.resume_point(self.checkpoints, remote, log)
        if latest is not None:  # e.g. a checkpoint from `checkpoint.uri`, saved under another config
            change = config_history.check_checkpoint(run_dir, latest.path, cfg, allow_config_change)
            if change is not None:
                config_history.record(run_dir, change, allow_config_change)
                log(f"config differs from checkpoint {latest.path.name} (accepted with --allow-config-change): "
                    f"{change.describe(change.forced)}")
        self.saver = ckpt.Saver(self.checkpoints, keep=c.keep, keep_every=c.keep_every, remote=remote,
                                asynchronous=c.async_save, log=log)
        self.stop_signal: str | None = None
        model_dir = latest.model_dir if latest else start_model_dir
        self.policy = load_model(model_dir, dtype=cfg.model.dtype, device=cfg.run.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.ref = None
        if algo.kl_coef > 0:
            self.ref = load_model(start_model_dir, dtype=cfg.model.dtype, device=cfg.run.device).eval()
            self.ref.requires_grad_(False)
        self.kl = KLController(algo.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon)
        self.optimizer = make_optimizer(self.policy, lr=algo.lr, weight_decay=algo.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, warmup_steps=algo.warmup_steps, total_steps=cfg.train.steps)
        self.critic = self.critic_optimizer = None
        if algo.estimator in NEEDS_CRITIC:
            critic_dir = latest.path / "critic" if latest else start_model_dir
            self.critic = Critic.from_pretrained(critic_dir, dtype=cfg.model.dtype, device=cfg.run.device)
            self.critic_optimizer = make_optimizer(self.critic, lr=algo.critic.lr)
        self.episodic = is_episodic(cfg, train_tasks)
        mixture = cfg.data.mixture
        self.sampler = MixtureSampler(train_tasks, mixture, cfg.run.seed) if mixture else \
            TaskSampler(train_tasks, seed=cfg.run.seed)
        self.start_step = 0
        if latest is not None:
            state = latest.load_into(self.optimizer, self.scheduler)
            self.sampler.load_state_dict(state["sampler"])
            if "kl" in state:
                self.kl.load_state_dict(state["kl"])
            if self.critic_optimizer is not None:
                self.critic_optimizer.load_state_dict(torch.load(latest.path / "critic" / "optimizer.pt",
                                                                 map_location="cpu", weights_only=False))
            self.start_step = latest.step
            log(f"resuming from {latest.path.name}")

    # ------------------------------------------------------------------------------------ one step

    def sample_round(self, step: int, round_: int, sandbox: Sandbox, timer: Timer):
        """One round of sampling: `prompts_per_step` tasks x `group_size`, executed and rewarded.
        -> (batch, trajectories or episodes, rewards, truncated (B,))"""
        cfg, ro = self.cfg, self.cfg.rollout
        generator = step_generator(cfg.run.seed, step, 0 if round_ == 0 else 10 + round_)
        offset = round_ * ro.prompts_per_step
        tasks = self.sampler.next_batch(ro.prompts_per_step)
        if self.episodic:
            with timer("gen"):
                episodes = run_episodes(
                    self.policy, self.tokenizer, tasks, env_context(cfg, sandbox), group_size=ro.group_size,
                    max_new_tokens=ro.max_new_tokens, max_context=cfg.env.max_context, temperature=ro.temperature,
                    top_p=ro.top_p, generator=generator, seed=step_seed(cfg.run.seed, step, 4 + round_),
                    chat=cfg.env.chat_format)
            rewards = episode_rewards(episodes, cfg.env.weights, self.reward_fn.step_fn)
            batch = collate_episodes(episodes, rewards, self.tokenizer.pad_token_id, group_offset=offset)
            return batch, episodes, rewards, torch.tensor([e.truncated for e in episodes])
        with timer("gen"):
            trajectories, gen = sample(
                self.policy, self.tokenizer, tasks, group_size=ro.group_size, max_new_tokens=ro.max_new_tokens,
                temperature=ro.temperature, top_p=ro.top_p, generator=generator)
        with timer("reward"):
            execute(trajectories, sandbox, self.reward_fn.needs, self.reference_cpu)
            rewards = self.reward_fn.batch(trajectories)
        batch = collate(gen, trajectories, rewards, group_offset=offset, tokenizer=self.tokenizer)
        return batch, trajectories, rewards, gen.truncated

    def collect(self, step: int, sandbox: Sandbox, timer: Timer):
        """Sample, execute and reward `prompts_per_step` tasks x `group_size`. With DAPO's dynamic sampling,
        groups whose rewards are all equal are dropped and more tasks are sampled (at most
        `max_sampling_rounds` rounds), then the batch is cut to `prompts_per_step` groups."""
        cfg, ro = self.cfg, self.cfg.rollout
        parts, kept_groups, dropped = [], 0, 0
        for round_ in range(cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling else 1):
            batch, items, rewards, truncated = self.sample_round(step, round_, sandbox, timer)
            if not cfg.algo.dynamic_sampling:
                return batch, items, rewards, truncated, {}
            # The full score (an episode's outcome plus its process rewards) decides what is informative.
            scores = torch.tensor([r.score for r in rewards], dtype=torch.float32)
            _, std, _ = group_mean_std(scores, batch.group_ids)
            informative = [i for i in range(len(items)) if std[i] > 0]
            groups = set(sorted({int(batch.group_ids[i]) for i in informative})[: ro.prompts_per_step - kept_groups])
            rows = [i for i in informative if int(batch.group_ids[i]) in groups]
            dropped += ro.prompts_per_step - len({int(batch.group_ids[i]) for i in informative})
            kept_groups += len(groups)
            parts.append((batch.select(torch.tensor(rows, dtype=torch.long)), [items[i] for i in rows],
                          [rewards[i] for i in rows], truncated[rows]))
            if kept_groups >= ro.prompts_per_step:
                break
        parts = [p for p in parts if len(p[1])] or parts[:1]
        batch = concat_batches([p[0] for p in parts])
        extra = {"dapo/kept_groups": kept_groups, "dapo/dropped_groups": dropped, "dapo/rounds": round_ + 1}
        return (batch, [t for p in parts for t in p[1]], [r for p in parts for r in p[2]],
                torch.cat([p[3] for p in parts]), extra)

    def step(self, step: int, sandbox: Sandbox) -> tuple[dict[str, float], list[dict]]:
        cfg, ro, algo = self.cfg, self.cfg.rollout, self.cfg.algo
        timer = Timer()
        with timer("step"):
            batch, items, rewards, truncated, extra = self.collect(step, sandbox, timer)
            if len(batch) == 0:  # dynamic sampling found no group with a learning signal
                metrics = {"actor/trained_fraction": 0.0, **extra}
                metrics.update(timer.seconds)
                return metrics, []
            if self.ref is not None:
                with timer("ref"), torch.no_grad():
                    ref_logprobs, _ = response_logprobs(
                        self.ref, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.attention,
                        temperature=ro.temperature)
                    batch.ref_logprobs = ref_logprobs.cpu()  # the batch stays on the CPU (see RolloutBatch.to)
            token_rewards = batch.token_rewards
            kl_metrics = {}
            if self.ref is not None and algo.kl_mode == "reward":
                kl = KL_ESTIMATORS[algo.kl_estimator](batch.old_logprobs, batch.ref_logprobs) * batch.response_mask
                penalty = -self.kl.coef * kl
                token_rewards = penalty if token_rewards is None else token_rewards + penalty
                kl_metrics["actor/reward_kl"] = float(masked_mean(kl, batch.response_mask))
            if self.critic is not None:
                with timer("values"), torch.no_grad():
                    batch.values = self.critic.values(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                                      batch.response_mask, batch.response_attention).cpu()
            with timer("adv"):
                batch.advantages, batch.returns = self.estimator(
                    batch.rewards, batch.response_mask, batch.group_ids, values=batch.values,
                    token_rewards=token_rewards, scale_by_std=algo.scale_by_std, gamma=algo.gamma, lam=algo.lam,
                )
                if algo.whiten_advantages:
                    batch.advantages = masked_whiten(batch.advantages, batch.response_mask) * batch.response_mask
            metrics: dict[str, float] = {}
            if self.critic is not None:
                with timer("critic"):
                    metrics.update(update_critic(
                        self.critic, self.critic_optimizer, batch, generator=step_generator(cfg.run.seed, step, 3),
                        epochs=algo.critic.epochs, minibatches=algo.minibatches, clip_range=algo.critic.value_clip,
                        max_grad_norm=algo.max_grad_norm))
            with timer("update"):
                train_batch = batch.informative() if algo.skip_zero_advantage else batch
                if self.critic is None or step > algo.critic.warmup_steps:
                    metrics.update(update_policy(
                        self.policy, self.optimizer, train_batch, policy_loss=self.policy_loss,
                        generator=step_generator(cfg.run.seed, step, 1), ppo_epochs=algo.ppo_epochs,
                        minibatches=algo.minibatches, clip_ratio=algo.clip_ratio, clip_ratio_low=algo.clip_ratio_low,
                        clip_ratio_high=algo.clip_ratio_high, clip_ratio_c=algo.clip_ratio_c, loss_agg=algo.loss_agg,
                        norm_length=ro.max_new_tokens * (cfg.env.max_turns if self.episodic else 1),
                        kl_coef=self.kl.coef if algo.kl_mode == "loss" else 0.0,
                        kl_estimator=algo.kl_estimator, entropy_coef=algo.entropy_coef,
                        max_grad_norm=algo.max_grad_norm, temperature=ro.temperature,
                    ))
                metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
            if self.ref is not None:
                observed = kl_metrics.get("actor/reward_kl", metrics.get("actor/kl_loss", 0.0))
                metrics["actor/kl_coef"] = self.kl.coef
                self.kl.update(observed, n_steps=len(batch))  # samples in the step, as in Ziegler et al.
            metrics.update(kl_metrics)
            metrics.update((episode_metrics if self.episodic else rollout_metrics)(items, rewards, batch, truncated))
            metrics["actor/trained_fraction"] = len(train_batch) / len(batch)
            metrics.update(extra)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                with timer("val"):
                    metrics.update(self.validate(step, sandbox))
        metrics.update(timer.seconds)
        metrics["perf/tokens_per_s"] = batch.num_tokens() / timer.seconds["timing_s/step"]
        return metrics, (episode_rows if self.episodic else sample_rows)(items, rewards, batch)

    def validate(self, step: int, sandbox: Sandbox) -> dict[str, float]:
        """Held-out pass@1 on the first `eval.val_tasks` tasks: sampled (2 per task) and greedy."""
        tasks = self.heldout_tasks[: self.cfg.eval.val_tasks]
        seed = step_seed(self.cfg.run.seed, step, 2)
        if self.episodic:
            return self.validate_episodes(tasks, seed, sandbox)
        sampled = evaluate(self.policy, self.tokenizer, tasks, sandbox, samples=2,
                           temperature=self.cfg.eval.temperature, max_new_tokens=self.cfg.rollout.max_new_tokens,
                           seed=seed)
        greedy = evaluate(self.policy, self.tokenizer, tasks, sandbox, greedy=True,
                          max_new_tokens=self.cfg.rollout.max_new_tokens)
        m = {"val/pass@1": sampled.overall["pass@1"], "val/greedy_pass@1": greedy.overall["pass@1"]}
        for domain, scores in sampled.per_domain.items():
            m[f"val/{domain}/pass@1"] = scores["pass@1"]
        return m

    def validate_episodes(self, tasks: list[Task], seed: int, sandbox: Sandbox) -> dict[str, float]:
        cfg = self.cfg
        kw = dict(max_new_tokens=cfg.rollout.max_new_tokens, max_context=cfg.env.max_context,
                  chat=cfg.env.chat_format)
        ctx = env_context(cfg, sandbox)
        sampled = evaluate_episodes(self.policy, self.tokenizer, tasks, ctx, samples=2,
                                    temperature=cfg.eval.temperature, seed=seed, **kw)
        greedy = evaluate_episodes(self.policy, self.tokenizer, tasks, ctx, greedy=True, **kw)
        m = {"val/pass@1": sampled.overall["pass@1"], "val/greedy_pass@1": greedy.overall["pass@1"],
             "val/first_turn_pass@1": sampled.overall["first_turn_pass@1"]}
        for domain, scores in sampled.per_domain.items():
            m[f"val/{domain}/pass@1"] = scores["pass@1"]
        return m

    # ---------------------------------------------------------------------------------- the loop

    def run(self, sandbox: Sandbox, tracker: Tracker) -> int:
        """Run the remaining steps (or until `train.max_time_s` has passed); returns the last step run.

        SIGTERM (a preemptible machine going away) ends the current step, saves, waits for the save and
        raises `Preempted`; running the same command again resumes."""
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if _main_thread() else None
        try:
            return self._run(sandbox, tracker)
        finally:
            self.saver.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_signal = "SIGTERM"

    def _run(self, sandbox: Sandbox, tracker: Tracker) -> int:
        cfg = self.cfg
        pending_checkpoint_s = 0.0
        began = time.monotonic()
        step = self.start_step
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
            out_of_time = cfg.train.max_time_s is not None and time.monotonic() - began >= cfg.train.max_time_s
            if step % cfg.checkpoint.every == 0 or step == cfg.train.steps or out_of_time or self.stop_signal:
                start = time.perf_counter()
                self.save(step)
                pending_checkpoint_s = time.perf_counter() - start
            if self.stop_signal:
                self.saver.close()
                raise Preempted(f"{self.stop_signal}: saved step {step} in {self.checkpoints}; run the same "
                                "command again to resume")
            if out_of_time:
                self.log(f"train.max_time_s ({cfg.train.max_time_s:.0f} s) reached after step {step}")
                break
        return step

    def save(self, step: int) -> None:
        """Snapshot the state now; the saver writes (and uploads) it while training goes on."""
        extra = None
        if self.critic is not None:
            backbone, head = ckpt.cpu_copy(self.critic.backbone.state_dict()), ckpt.cpu_copy(self.critic.head.state_dict())
            optimizer = copy.deepcopy(self.critic_optimizer.state_dict())
            critic = self.critic

            def extra(directory: Path) -> None:
                critic.save_snapshot(directory / "critic", backbone, head)
                torch.save(optimizer, directory / "critic" / "optimizer.pt")

        snap = ckpt.snapshot(
            step, model=self.policy, tokenizer=self.tokenizer, optimizer=self.optimizer, scheduler=self.scheduler,
            trainer_state={"sampler": self.sampler.state_dict(), "kl": self.kl.state_dict()},
            config_yaml=self.cfg.to_yaml(), extra=extra,
        )
        self.saver.save(snap)


def env_context(cfg: RunConfig, sandbox: Sandbox | None) -> EnvContext:
    """What the environments of a run get: the sandbox, `env.*`, and the reward-hacking guard settings."""
    e, r = cfg.env, cfg.reward
    options = {"guards": r.guards, "guard_kinds": r.guard_kinds, **e.options.model_dump()}
    return EnvContext(sandbox=sandbox, max_turns=e.max_turns, feedback_chars=e.feedback_chars, options=options)


def is_episodic(cfg: RunConfig, tasks: list[Task]) -> bool:
    """Whether RL runs through the environments (see `env.episodes`)."""
    if cfg.env.episodes is not None:
        return cfg.env.episodes
    return cfg.env.max_turns > 1 or any(t.env != "code" for t in tasks)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
