"""Reverse a word: the model is shown a word and answers it spelt backwards.

The checker gives partial credit, the fraction of letters in their place (`letters`, an outcome
component); with `env.max_turns` > 1 a wrong answer is told how many letters were in place and may try again.
"""

from __future__ import annotations

from tempering.envs import Environment, Step
from tempering.types import Task


def letters_in_place(answer: str, expected: str) -> int:
    """How many of `expected`'s letters `answer` has in the same place."""
    return sum(a == b for a, b in zip(answer, expected))


class ReverseEnv(Environment):
    kind = "reverse"
    components = outcome = frozenset({"letters"})
    default_weights = {"letters": 1.0}

    def reset(self, task: Task) -> str:
        self.task, self.turn = task, 0
        return task.prompt

    def step(self, action: str) -> Step:
        self.turn += 1
        lines = action.strip().splitlines()
        answer = lines[0].strip() if lines else ""
        expected = str(self.task.answer)
        hits = letters_in_place(answer, expected)
        score = hits / max(len(expected), len(answer), 1)  # letters beyond the word count wrong
        done = score == 1.0 or self.turn >= self.ctx.max_turns
        feedback = None if done else f"# {hits} of {len(expected)} letters in place, try again\n"
        return Step(feedback, {"letters": score}, done, {"answer": answer}, success=score == 1.0)
