"""What one RL step logs: its metric row (verl-style names) and its sample rows, for single-turn
trajectories and for multi-turn episodes."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from tempering.rewards import GUARDS
from tempering.types import EXEC_STATUSES, RewardResult, Trajectory

if TYPE_CHECKING:
    from tempering.rollout.batch import RolloutBatch
    from tempering.rollout.episodes import Episode


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
    for kind in GUARDS:
        m[f"reward/hacking/{kind}"] = sum(kind in r.info.get("hacking", ()) for r in rewards) / len(rewards)
    m.update(domain_rewards([t.task.domain for t in trajectories], scores))
    statuses = Counter(t.exec_result.status for t in trajectories)
    for status in EXEC_STATUSES:
        if statuses[status]:
            m[f"sandbox/status/{status}"] = statuses[status] / len(trajectories)
    return m


def domain_rewards(domains: list[str], scores: torch.Tensor) -> dict[str, float]:
    """`reward/<domain>/mean` for every domain in the batch."""
    by: dict[str, list[float]] = {}
    for d, r in zip(domains, scores.tolist()):
        by.setdefault(d, []).append(r)
    return {f"reward/{d}/mean": sum(v) / len(v) for d, v in sorted(by.items())}


def episode_metrics(episodes: list[Episode], rewards: list[RewardResult], batch: RolloutBatch,
                    truncated: torch.Tensor) -> dict[str, float]:
    n = len(episodes)
    scores = torch.tensor([r.score for r in rewards])
    m = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if n > 1 else 0.0,
        "train/pass_rate": sum(e.success for e in episodes) / n,
        "train/first_turn_pass_rate": sum(e.first_success for e in episodes) / n,
        "num_turns/mean": sum(len(e.turns) for e in episodes) / n,
        "response_length/mean": float(batch.response_mask.sum(1).mean()),
        "response_length/clip_ratio": float(truncated.float().mean()),
        "critic/advantages/mean": float((batch.advantages * batch.response_mask).sum()
                                        / batch.response_mask.sum().clamp_min(1)),
    }
    names = sorted({k for r in rewards for k in r.components})
    for name in names:
        m[f"reward/{name}/mean"] = sum(r.components.get(name, 0.0) for r in rewards) / n
    m.update(domain_rewards([e.task.domain for e in episodes], scores))
    return m


def episode_rows(episodes: list[Episode], rewards: list[RewardResult], batch: RolloutBatch) -> list[dict]:
    rows = []
    for i, (e, reward) in enumerate(zip(episodes, rewards)):
        policy = batch.response_mask[i].nonzero()
        rows.append({
            "task_id": e.task.id, "domain": e.task.domain, "group": e.group_id, "prompt": e.task.prompt,
            "turns": [{"action": t.action, "observation": t.observation, "rewards": t.rewards} for t in e.turns],
            "truncated": e.truncated, "success": e.success, "reward": reward.score, "components": reward.components,
            "advantage": float(batch.advantages[i, policy[0, 0]]) if len(policy) else 0.0,
        })
    return rows


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
