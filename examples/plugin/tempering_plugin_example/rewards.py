"""A reward function of one's own: `fn(task, trajectory, **params) -> float`, named in `reward.weights` by
import path and given `reward.params` under the same name."""

from __future__ import annotations

from tempering.types import Task, Trajectory


def one_line(task: Task, traj: Trajectory, *, max_chars: int = 12) -> float:
    """Format reward: 1 when the answer ended on its own and is one line of at most `max_chars` characters."""
    text = traj.completion.strip()
    return float(not traj.truncated and "\n" not in text and 0 < len(text) <= max_chars)
