"""A reward function of one's own: `fn(task, attempt, **params) -> float`, named in `reward.weights` by
import path and given `reward.params` under the same name."""

from __future__ import annotations

from tempering.types import Attempt, Task


def one_line(task: Task, attempt: Attempt, *, max_chars: int = 12) -> float:
    """Format reward: 1 when the answer ended on its own and is one line of at most `max_chars` characters."""
    text = attempt.completion.strip()
    return float(not attempt.truncated and "\n" not in text and 0 < len(text) <= max_chars)
