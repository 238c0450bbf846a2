"""Code with execution feedback: the model submits a program, the sandbox runs it, failures come back.

With `max_turns` 1 this is the single-turn code task; with more, a failed attempt is answered with what
went wrong and the model may revise. The feedback shows the visible examples that fail with their
expected values (the model saw those in the prompt anyway), and for the hidden tests only how many fail
and any error (exception, timeout) - never a hidden expected value, which the next attempt could simply
copy. The episode is judged on its final attempt (`tests`: the fraction of hidden tests passed); the
process component `improvement` is the gain in that fraction over the previous attempt (the first
attempt's gain is over 0, so the improvements of an episode add up to its final score: failing first on
purpose earns nothing). The reward-hacking guards of single-turn runs check every attempt: a caught
attempt scores 0 tests and earns the process component `hacking` (weight -1 by default).
"""

from __future__ import annotations

import re
from dataclasses import replace

from tempering.envs.base import Environment, Step, clip_middle, register
from tempering.rewards.guards import detect
from tempering.types import ExecResult, Task, Trajectory

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", re.S)


def with_examples(task: Task) -> Task:
    """The task with its visible examples appended to its tests (when they are of the same style), so one
    execution answers both; `split_examples` separates the results again."""
    if task.examples and task.examples[0].style == task.tests[0].style:
        return task.model_copy(update={"tests": task.tests + task.examples})
    return task


def split_examples(result: ExecResult, hidden: int) -> tuple[ExecResult, ExecResult | None]:
    """(the result on the first `hidden` tests, the result on the examples after them or None)."""
    examples = replace(result, tests=result.tests[hidden:]) if len(result.tests) > hidden else None
    return replace(result, tests=result.tests[:hidden]), examples


def program_of(task: Task, action: str) -> str:
    """The program an action stands for: a fenced code block or the text itself; a text that does not
    define the entry point continues the prompt (the function body of a completion-style task)."""
    fenced = _FENCE.search(action)
    code = fenced.group(1) if fenced else action
    if task.entry_point and re.search(rf"^\s*def\s+{re.escape(task.entry_point)}\s*\(", code, re.M):
        return code
    return task.prompt + code


@register
class CodeEnv(Environment):
    kind = "code"
    outcome = frozenset({"tests"})
    default_weights = {"tests": 1.0, "improvement": 0.2, "hacking": -1.0}

    def reset(self, task: Task) -> str:
        self.task, self.turn, self.previous = task, 0, 0.0
        return task.prompt

    def step(self, action: str) -> Step:
        task = self.task
        self.turn += 1
        program = program_of(task, action)
        result = self.ctx.sandbox.run_tests(with_examples(task), program)
        n = len(task.tests)
        hidden, examples = split_examples(result, n)
        attempt = Trajectory(task=task, group_id=0, completion=program[len(task.prompt):]
                             if program.startswith(task.prompt) else program, truncated=False, exec_result=hidden,
                             example_result=examples)
        hacks = detect(task, attempt, self.ctx.options.get("guard_kinds"))
        caught = bool(hacks) and self.ctx.options.get("guards", True)
        score = 0.0 if caught else hidden.passed_fraction
        improvement, self.previous = score - self.previous, score
        success = hidden.all_passed and not caught
        done = success or self.turn >= self.ctx.max_turns
        info = {"success": success, "status": result.status, "passed": score, "flags": result.flags, "hacking": hacks}
        observation = None if done else (f"# feedback: rejected ({', '.join(hacks)})\n" if caught
                                         else self.feedback(result, n))
        return Step(observation, {"tests": score, "improvement": improvement, "hacking": float(caught)}, done, info)

    def feedback(self, result: ExecResult, hidden: int) -> str:
        """One line: why nothing ran (the error's last line), or the failing visible examples (with expected
        values) and how many hidden tests fail, with their first error that is not a wrong value."""
        examples = [t for t in result.tests[hidden:] if not t.passed]
        failed_hidden = [t for t in result.tests[:hidden] if not t.passed]
        failed = examples + failed_hidden
        if failed and all((t.error or "").startswith("no result") for t in failed):
            parts = [result.status, last_line(result.stderr) or last_line(failed[0].error or "")]
        else:
            # A visible example's message whole (its expected value may span lines; the model saw it anyway).
            parts = [(t.error or "failed").strip().replace("\n", "\\n") for t in examples[:2]]
            if failed_hidden:
                parts.append(f"{len(failed_hidden)} of {hidden} hidden tests fail")
                errors = [last_line(t.error) for t in failed_hidden if t.error and not _reveals_expected(t.error)]
                parts += errors[:1]
        text = "; ".join(dict.fromkeys(p for p in parts if p)) or result.status  # each message once
        return f"# feedback: {clip_middle(text, self.ctx.feedback_chars)}\n"


def _reveals_expected(error: str) -> bool:
    """A wrong-value message (call and stdin tests name the expected value) or a failed assertion of
    check() test code (whose message may hold it): not shown for hidden tests."""
    return " expected " in error or error.startswith(("expected ", "assertion failed"))


def last_line(text: str) -> str:
    """The last non-empty line of an error text (a traceback's exception line)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
