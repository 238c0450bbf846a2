"""Code with execution feedback: the model submits a program, the sandbox runs it, failures come back.

With `max_turns` 1 this is the single-turn code task; with more, a failed attempt is answered with what
went wrong and the model may revise. The feedback shows the visible examples that fail with their
expected values (the model saw those in the prompt anyway), and for the hidden tests only how many fail
and any error (exception, timeout) - never a hidden expected value, which the next attempt could simply
copy. Each step carries the attempt (`Step.attempt`), on which the reward function computes its
components (`tests`, `format`, `style`, ...) for the episode's final attempt. The process component
`improvement` is the gain in the passed fraction over the previous attempt (the first attempt's gain is
over 0, so the improvements of an episode add up to its final score: failing first on purpose earns
nothing). The reward-hacking guards check every attempt: a caught attempt counts 0 for `improvement`, is
answered "rejected", and the reward function gives the episode `reward.penalty`.

Steps are batched (`step_batch`): the programs of all running episodes go to the sandbox together, each
distinct program once, and one ruff process lints them all.
"""

from __future__ import annotations

import re
from dataclasses import replace

from tempering.envs.base import EnvContext, Environment, Step, clip_middle, register
from tempering.rewards import tests_passed
from tempering.rewards.guards import detect
from tempering.rewards.lint import lint_findings
from tempering.types import Attempt, ExecResult, Task

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
    components = frozenset({"improvement"})
    default_weights = {"tests": 1.0, "format": 0.1}

    def reset(self, task: Task) -> str:
        self.task, self.turn, self.previous = task, 0, 0.0
        instruction = self.ctx.options.get("code_instruction")
        return f"{instruction}\n\n{task.prompt}" if instruction else task.prompt

    def step(self, action: str) -> Step:
        return self.step_batch([self], [action])[0]

    @classmethod
    def step_batch(cls, envs: list[CodeEnv], actions: list[str], pool=None) -> list[Step]:
        """Run every program once per distinct (task, program) - a group often repeats itself - in one
        sandbox batch, with the visible examples riding along as extra tests; lint them in one ruff
        process and time the reference solutions when the reward needs it (`ctx.needs`)."""
        if not envs:
            return []
        ctx = envs[0].ctx
        needs = ctx.needs
        programs = [program_of(env.task, action) for env, action in zip(envs, actions)]
        unique: dict[tuple[str, str], int] = {}  # (task id, program) -> index of its execution
        runs: list[int] = []  # the env whose program each execution runs
        for k, (env, program) in enumerate(zip(envs, programs)):
            if (env.task.id, program) not in unique:
                unique[(env.task.id, program)] = len(runs)
                runs.append(k)
        results = ctx.sandbox.run_tests_batch([(with_examples(envs[k].task), programs[k]) for k in runs])
        lint = (
            lint_findings([programs[k] if envs[k].task.language == "python" else None for k in runs])
            if "lint" in needs
            else [None] * len(runs)
        )
        reference = reference_times(ctx, [env.task for env in envs]) if "reference" in needs else {}
        steps = []
        for env, program in zip(envs, programs):
            i = unique[(env.task.id, program)]
            steps.append(env.judge(program, results[i], lint[i], reference.get(env.task.id)))
        return steps

    def judge(
        self, program: str, result: ExecResult, lint: int | None, reference_cpu_s: float | None
    ) -> Step:
        """One attempt's verdict: the attempt itself (the Attempt the reward components read), its score as
        the `tests` reward gives it, the process component `improvement`, guard detections, and the feedback
        when another attempt follows."""
        task = self.task
        self.turn += 1
        n = len(task.tests)
        hidden, examples = split_examples(result, n)
        completion = program[len(task.prompt) :] if program.startswith(task.prompt) else program
        attempt = Attempt(
            task=task,
            group_id=self.group_id,
            completion=completion,
            truncated=False,
            exec_result=hidden,
            example_result=examples,
            lint_findings=lint,
            reference_cpu_s=reference_cpu_s,
        )
        hacks = detect(task, attempt, self.ctx.guard_kinds)
        caught = bool(hacks) and self.ctx.guards
        score = 0.0 if caught else tests_passed(task, attempt, partial=self.ctx.partial)
        improvement, self.previous = score - self.previous, score
        success = hidden.all_passed and not caught
        done = success or self.turn >= self.ctx.max_turns
        observation = (
            None
            if done
            else (f"# feedback: rejected ({', '.join(hacks)})\n" if caught else self.feedback(result, n))
        )
        return Step(
            observation,
            {"improvement": improvement},
            done,
            success=success,
            attempt=attempt,
            passed=score,
            hacking=tuple(hacks),
        )

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
                parts += shareable_errors(failed_hidden)[:1]
        text = "; ".join(dict.fromkeys(p for p in parts if p)) or result.status  # each message once
        return f"# feedback: {clip_middle(text, self.ctx.feedback_chars)}\n"


def shareable_errors(failed_hidden) -> list[str]:
    """The last lines of failing hidden tests' errors that may be shown to the model or a person: none that
    reveals a hidden test's expected value (or its input with it)."""
    return [last_line(t.error) for t in failed_hidden if t.error and not _reveals_expected(t.error)]


def _reveals_expected(error: str) -> bool:
    """A wrong-value message (call and stdin tests name the expected value) or a failed assertion of
    check() test code (whose message may hold it): not shown for hidden tests."""
    return " expected " in error or error.startswith(("expected ", "assertion failed"))


def last_line(text: str) -> str:
    """The last non-empty line of an error text (a traceback's exception line)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reference_times(ctx: EnvContext, tasks: list[Task]) -> dict[str, float | None]:
    """CPU time of each task's reference solution when it passes (None otherwise), cached for the run in
    `ctx.reference_cpu` (the efficiency reward compares against it)."""
    cache = ctx.reference_cpu
    missing = {t.id: t for t in tasks if t.id not in cache and t.reference_solution}
    if missing:
        results = ctx.sandbox.run_tests_batch([(t, t.reference_solution) for t in missing.values()])
        for task_id, r in zip(missing, results):
            cache[task_id] = r.cpu_time_s if r.all_passed else None
    return {t.id: cache.get(t.id) for t in tasks}
