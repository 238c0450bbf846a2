"""What one RL step logs: its metric row (verl-style names) and its sample rows."""

from __future__ import annotations

from collections import Counter

import torch

from tempering.rewards import GUARDS
from tempering.rollout.batch import RolloutBatch
from tempering.types import EXEC_STATUSES, Episode, RewardResult


def rollout_metrics(
    episodes: list[Episode], rewards: list[RewardResult], batch: RolloutBatch
) -> dict[str, float]:
    n = len(episodes)
    scores = torch.tensor([r.score for r in rewards])
    m = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if n > 1 else 0.0,
        "train/pass_rate": sum(e.success for e in episodes) / n,
        "train/first_turn_pass_rate": sum(e.first_success for e in episodes) / n,
        "num_turns/mean": sum(len(e.turns) for e in episodes) / n,
        "response_length/mean": float(batch.response_mask.sum(1).mean()),
        # An episode whose last action the token budget cut, or whose context budget ran out.
        "response_length/clip_ratio": sum(
            e.truncated or not (e.turns and e.turns[-1].ended) for e in episodes
        )
        / n,
        "critic/advantages/mean": float(
            (batch.advantages * batch.response_mask).sum() / batch.response_mask.sum().clamp_min(1)
        ),
    }
    for name in sorted({k for r in rewards for k in r.components}):
        m[f"reward/{name}/mean"] = sum(r.components.get(name, 0.0) for r in rewards) / n
    for kind in GUARDS:
        m[f"reward/hacking/{kind}"] = sum(kind in r.info.get("hacking", ()) for r in rewards) / n
    by_domain: dict[str, list[float]] = {}
    for e, r in zip(episodes, scores.tolist()):
        by_domain.setdefault(e.task.domain, []).append(r)
    m.update({f"reward/{d}/mean": sum(v) / len(v) for d, v in sorted(by_domain.items())})
    later = [(e, k) for e in episodes for k in range(1, len(e.turns)) if not e.proxy]
    if later:  # a turn after the first: the engine computes only what its cache lacks
        m["rollout/prefill_tokens_per_turn"] = sum(e.turns[k].computed for e, k in later) / len(later)
        m["rollout/new_tokens_per_turn"] = sum(_new_tokens(e, k) for e, k in later) / len(later)
    runs = [e.proxy for e in episodes if e.proxy]
    if runs:  # runs of the user's agent, through the recording proxy (`agent.episodes`)
        m["proxy/forks"] = sum(r.get("forks", 0.0) for r in runs)
        for name in ("token_exact_fraction", "rerender_exact_fraction"):
            values = [r[name] for r in runs if name in r]
            if values:
                m[f"proxy/{name}"] = sum(values) / len(values)
        m["agent/failed"] = sum(r["failed"] for r in runs) / len(runs)
        m["agent/timeouts"] = sum(r["timeout"] for r in runs) / len(runs)
    statuses = Counter(e.turns[-1].status for e in episodes if e.turns and e.turns[-1].status)
    for status in EXEC_STATUSES:
        if statuses[status]:
            m[f"sandbox/status/{status}"] = statuses[status] / n
    return m


def _new_tokens(e: Episode, k: int) -> int:
    """Context tokens that turn k adds to what sampled turn k-1: that action's last token (sampled, so never
    computed) and the observation after it."""
    return e.turn_ends[k] + 1 - e.turns[k].tokens - e.turn_ends[k - 1]


def sample_rows(episodes: list[Episode], rewards: list[RewardResult], batch: RolloutBatch) -> list[dict]:
    rows = []
    for i, (e, reward) in enumerate(zip(episodes, rewards)):
        policy = batch.response_mask[i].nonzero()
        rows.append(
            {
                "task_id": e.task.id,
                "domain": e.task.domain,
                "group": e.group_id,
                "policy_version": e.version,
                "prompt": e.task.prompt,
                "turns": [
                    {
                        "action": t.action,
                        "observation": t.observation,
                        "rewards": t.rewards,
                        **({"status": t.status} if t.status else {}),
                    }
                    for t in e.turns
                ],
                "truncated": e.truncated,
                "success": e.success,
                "reward": reward.score,
                "components": reward.components,
                "advantage": float(batch.advantages[i, policy[0, 0]]) if len(policy) else 0.0,
            }
        )
    return rows
