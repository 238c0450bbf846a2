"""Every metric a run writes, with its unit and what it means: one registry, read by the docs' metrics
reference (tools/gen_docs.py) and by the test that checks a real run's rows against it.

A name with `<...>` in it stands for a family: the placeholder matches one path segment (no `/`), e.g.
`reward/<component>/mean` covers `reward/tests/mean`. A metric added to the code needs an entry here, or
tests/test_docs.py fails.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Metric(NamedTuple):
    unit: str
    """What the value counts: `fraction` (0 to 1), `s`, `tokens`, ... ('' for a plain number)."""
    doc: str
    """What it means, and when it is there if not in every row."""


METRICS: dict[str, Metric] = {
    # The step's episodes and their rewards (tracking/metrics.py)
    "reward/mean": Metric(
        "",
        "Mean reward of the step's episodes: each the weighted sum of its components (reward.penalty when a guard caught it).",
    ),
    "reward/std": Metric("", "Standard deviation of those rewards."),
    "reward/<component>/mean": Metric(
        "", "Mean of one reward component before its weight (tests, format, improvement, success, step, ...)."
    ),
    "monitor/alerts": Metric(
        "domains",
        "Mixture runs, validation rows: domains whose pass@1 fell past their interval (below their best), eval/monitor.py.",
    ),
    "monitor/<domain>/alert": Metric(
        "", "1 in the validation row where that domain fell (absent otherwise)."
    ),
    "monitor/<domain>/suspect": Metric(
        "",
        "1 where that domain fell while its training reward held (a possible exploit: its weight is not raised).",
    ),
    "monitor/<domain>/weight": Metric(
        "", "The domain's mixture weight after the monitor acted (validation rows of mixture runs)."
    ),
    "reward/<domain>/mean": Metric("", "Mean reward of the step's episodes of one task domain."),
    "reward/hacking/<guard>": Metric(
        "fraction",
        "Share of episodes caught by one reward-hacking guard (logged whether guards are on or not).",
    ),
    "train/pass_rate": Metric("fraction", "Share of episodes whose final attempt passed."),
    "train/first_turn_pass_rate": Metric("fraction", "Share of episodes whose first attempt passed."),
    "train/guided_groups": Metric(
        "groups",
        "Groups whose samples all failed that got the task's reference solution as their last sample "
        "(`algo.guidance: reference`); pass rates and rewards count that sample.",
    ),
    "num_turns/mean": Metric("turns", "Mean number of actions per episode."),
    "response_length/mean": Metric("tokens", "Mean number of policy tokens per episode."),
    "response_length/clip_ratio": Metric(
        "fraction", "Share of episodes cut by the token budget or the context budget."
    ),
    "critic/advantages/mean": Metric("", "Mean advantage over the batch's policy tokens."),
    "rollout/prefill_tokens_per_turn": Metric(
        "tokens",
        "Multi-turn: context tokens the engine computed per turn after the first (what its cache lacked).",
    ),
    "rollout/new_tokens_per_turn": Metric(
        "tokens",
        "Multi-turn: context tokens each turn after the first adds (last action token and observation).",
    ),
    "proxy/forks": Metric(
        "calls",
        "Runs of your agent (agent.entry): calls of the step's sessions that extended no recorded turn (a rewritten history), each a new branch not trained on.",
    ),
    "proxy/token_exact_fraction": Metric(
        "fraction",
        "Runs of your agent: share of recorded turns whose trained tokens are, token for token, the prompt the engine computed and the ids it sampled.",
    ),
    "proxy/rerender_exact_fraction": Metric(
        "fraction",
        "Runs of your agent: share of recorded chat turns whose prompt equals a fresh render of their messages (below 1: what a re-rendering trainer would have trained on wrongly; the record keeps the computed ids).",
    ),
    "agent/failed": Metric(
        "fraction",
        "Runs of your agent that raised, exited badly or timed out (trained on as far as they got).",
    ),
    "agent/timeouts": Metric("fraction", "Runs of your agent killed at agent.timeout_s."),
    "sandbox/status/<status>": Metric(
        "fraction", "Share of episodes whose last execution ended with this status (ok, runtime_error, ...)."
    ),
    # The policy update (training/update.py, algos/losses.py, loop.py)
    "actor/pg_loss": Metric("", "Policy-gradient loss, mean over the step's optimizer steps."),
    "actor/entropy": Metric("nats", "Mean entropy of the policy over the trained tokens."),
    "actor/grad_norm": Metric("", "Policy gradient norm before clipping, mean over optimizer steps."),
    "actor/pg_clipfrac": Metric(
        "fraction", "Share of tokens whose ratio was clipped (CISPO: whose weight was)."
    ),
    "actor/pg_clipfrac_lower": Metric(
        "fraction", "Dual-clip (algo.clip_ratio_c): share of negative-advantage tokens whose loss was capped."
    ),
    "actor/ppo_kl": Metric("nats", "Approximate KL(old || new) per token (k1) over the update."),
    "actor/kl_loss": Metric(
        "nats", "KL to the reference per token, the loss term (algo.kl_coef > 0, kl_mode loss)."
    ),
    "actor/reward_kl": Metric(
        "nats", "KL to the reference per token, taken out of the reward (algo.kl_coef > 0, kl_mode reward)."
    ),
    "actor/kl_coef": Metric("", "The KL coefficient this step used (adaptive with algo.kl_target)."),
    "actor/lr": Metric("", "Policy learning rate this step."),
    "actor/trained_fraction": Metric(
        "fraction",
        "Share of the batch's samples the update trained on (algo.skip_zero_advantage drops the rest).",
    ),
    # The critic (estimators that need one: gae)
    "critic/vf_loss": Metric("", "Clipped value loss, mean over the critic's optimizer steps."),
    "critic/vf_clipfrac": Metric("fraction", "Share of tokens where the clipped value loss was the larger."),
    "critic/values/mean": Metric("", "Mean predicted value over the batch's tokens."),
    "critic/grad_norm": Metric("", "Critic gradient norm before clipping, mean over optimizer steps."),
    # Train/inference mismatch correction (algo.correction: tis or mis)
    "mismatch/kl": Metric(
        "nats", "KL (k3) between the sampler's log-probs and the trainer's recomputed ones."
    ),
    "mismatch/is_weight/mean": Metric("", "Mean importance weight pi_old / mu after truncation or masking."),
    "mismatch/clip_frac": Metric("fraction", "tis: share of tokens whose weight was truncated at the cap."),
    "mismatch/masked_frac": Metric(
        "fraction", "mis: share of tokens left out of the loss for a weight above the cap."
    ),
    # DAPO's dynamic sampling (algo.dynamic_sampling)
    "dapo/kept_groups": Metric("groups", "Groups with unequal rewards kept for the update."),
    "dapo/dropped_groups": Metric("groups", "Groups dropped because all their rewards were equal."),
    "dapo/rounds": Metric("rounds", "Sampling rounds the step took to fill its batch."),
    # Asynchronous rollouts (distributed/schedule.py)
    "async/staleness/min": Metric(
        "updates", "Fewest updates any sample's sampler was behind the trained policy."
    ),
    "async/staleness/mean": Metric(
        "updates", "Mean updates a sample's sampler was behind (0 when synchronous)."
    ),
    "async/staleness/max": Metric("updates", "Most updates any sample's sampler was behind."),
    # Ray rollout workers and trainers (distributed.backend: ray)
    "dist/workers": Metric("workers", "Rollout workers at the end of the step."),
    "dist/backlog": Metric("shards", "Shards waiting for a worker at the end of the step."),
    "dist/shard_retries": Metric("shards", "Shards re-sent because their worker died."),
    "dist/sandbox_retries": Metric("batches", "Sandbox batches re-sent because their sandbox actor died."),
    "dist/scale_ups": Metric("workers", "Workers added this step (elastic pool)."),
    "dist/scale_downs": Metric("workers", "Idle workers retired this step (elastic pool)."),
    "dist/trainers": Metric("trainers", "Data-parallel trainers (distributed.trainers > 1)."),
    "sync/canary_max_abs_diff": Metric(
        "nats", "Largest |log-prob difference| a rollout worker's weights showed on the canary probe."
    ),
    # Held-out validation (every eval.every steps; eval/evaluate.py)
    "val/pass@1": Metric("fraction", "Held-out pass@1, 2 samples per task at eval.temperature."),
    "val/greedy_pass@1": Metric("fraction", "Held-out pass@1, greedy."),
    "val/first_turn_pass@1": Metric(
        "fraction", "Held-out pass@1 of the first attempt (multi-turn episodes)."
    ),
    "val/<domain>/pass@1": Metric("fraction", "Held-out sampled pass@1 of one task domain."),
    # Time (tracking.Timer): seconds per phase of the step, summed when a phase runs more than once
    "timing_s/step": Metric("s", "The whole step."),
    "timing_s/wait": Metric(
        "s", "Waiting for the step's rollouts (all of the rollout time when synchronous)."
    ),
    "timing_s/gen": Metric("s", "Generation (sampling the actions)."),
    "timing_s/reward": Metric(
        "s", "Environment steps: executing the actions in the sandbox and scoring them."
    ),
    "timing_s/ref": Metric("s", "Reference-model log-probs (algo.kl_coef > 0)."),
    "timing_s/values": Metric("s", "Critic values of the batch (gae)."),
    "timing_s/recompute": Metric("s", "Recomputing pi_old for the mismatch correction."),
    "timing_s/guide": Metric("s", "Reference guidance: running and scoring the reference rows."),
    "timing_s/adv": Metric("s", "The advantage estimator."),
    "timing_s/critic": Metric("s", "The critic update."),
    "timing_s/update": Metric("s", "The policy update."),
    "timing_s/allreduce": Metric("s", "Gradient all-reduce between data-parallel trainers."),
    "timing_s/sync": Metric("s", "Publishing the new weights to the sampler(s)."),
    "timing_s/val": Metric("s", "Held-out validation."),
    "timing_s/checkpoint": Metric(
        "s", "Saving the previous step's checkpoint (reported in the row after it)."
    ),
    "perf/tokens_per_s": Metric("tokens/s", "The batch's tokens (prompts and responses) over timing_s/step."),
}
"""metrics.jsonl: one row per RL step, `step` plus these."""

SFT_METRICS: dict[str, Metric] = {
    "sft/loss": Metric("nats", "Mean negative log-likelihood per completion token of the SFT batch."),
    "sft/grad_norm": Metric("", "Gradient norm before clipping."),
    "sft/lr": Metric("", "Learning rate after the step."),
    "timing_s/step": Metric("s", "The SFT step."),
    "sft/val/pass@1": Metric(
        "fraction", "`sft.stop_at`'s check: sampled pass@1 (2 per task) on SFT's validation tasks."
    ),
    "sft/val/greedy_pass@1": Metric("fraction", "The same tasks, greedy."),
}
"""RUN_DIR/sft/metrics.jsonl: one row per warm-up step, `step` plus these."""

_PLACEHOLDER = re.compile(r"<[a-z_]+>")


def _pattern(name: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(name)
    return re.compile("[^/]+".join(map(re.escape, parts)) + r"\Z")


def describe(name: str, registry: dict[str, Metric] = METRICS) -> Metric | None:
    """The entry documenting a metric name (its own, else its family's), or None if none does."""
    if name in registry:
        return registry[name]
    for key, metric in registry.items():
        if "<" in key and _pattern(key).match(name):
            return metric
    return None
