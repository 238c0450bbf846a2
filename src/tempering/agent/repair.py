"""The repair agent: write code, run it in the sandbox, read what went wrong, try again.

For each task the agent asks its backend for a program, executes it with the code environment of
multi-turn RL (`envs.code.CodeEnv`: the same sandbox batch, the same tests, the same feedback text - one
line, clipped head and tail), classifies the outcome (`failures.classify`), and, while the task is not
solved, puts the feedback into the next user turn and asks again, up to `repairs` more times. An episode
also ends when it is stuck (OpenHands' rule, simplified): the new attempt fails with the same error as the
one before, or repeats an earlier program - asking again would only repeat it. With the plain format of
the tiny model a conversation renders to exactly the token sequence of a training episode, so a model
trained with `configs/code-repair.yaml` is the agent's model as it is.

All running episodes advance together: one batched generation (or concurrent HTTP requests) per round,
one sandbox batch. Every attempt is a JSON line in the log (`ATTEMPT_FIELDS`), and counts in the metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from tempering.agent.backends import ChatBackend
from tempering.agent.failures import FAILURE_CLASSES, classify
from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.envs import EnvContext
from tempering.envs.code import CodeEnv, program_of
from tempering.types import Task

ATTEMPT_FIELDS = ("event", "time", "model", "task_id", "attempt", "program", "class", "message", "traceback",
                  "visible_failures", "hidden_failed", "hidden_total", "passed_fraction", "feedback", "stuck", "final",
                  "ended", "latency_s", "prompt_tokens", "completion_tokens", "task")
"""One line of the attempt log. `task` is the task itself (prompt, entry point, tests), so that
`tempering data from-logs` can rebuild it; `ended` (on the final attempt) is solved, stuck, repairs
(none left), context (the model's context is full) or rejected."""


@dataclass(frozen=True)
class RepairSettings:
    repairs: int = 3
    """Attempts after the first one (aider allows 3 reflections)."""
    stop_when_stuck: bool = True
    max_tokens: int = 48
    """Most tokens of one attempt."""
    temperature: float = 0.0
    """0 = greedy."""
    seed: int = 0


@dataclass
class EpisodeOutcome:
    task_id: str
    classes: list[str] = field(default_factory=list)
    """The failure class of each attempt (`passed` for the one that solved it)."""
    ended: str = ""

    @property
    def solved(self) -> bool:
        return self.ended == "solved"

    @property
    def first_solved(self) -> bool:
        return self.classes[:1] == ["passed"]


@dataclass
class RepairReport:
    episodes: list[EpisodeOutcome]

    def summary(self) -> dict[str, float | int | dict]:
        n = max(1, len(self.episodes))
        first_classes = {c: sum(e.classes[:1] == [c] for e in self.episodes) for c in FAILURE_CLASSES}
        return {
            "tasks": len(self.episodes),
            "pass@1_single_shot": sum(e.first_solved for e in self.episodes) / n,
            "pass@1_with_repairs": sum(e.solved for e in self.episodes) / n,
            "stuck_rate": sum(e.ended == "stuck" for e in self.episodes) / n,
            "attempts/mean": sum(len(e.classes) for e in self.episodes) / n,
            "ended": {k: sum(e.ended == k for e in self.episodes)
                      for k in ("solved", "stuck", "repairs", "context", "rejected")},
            "first_attempt_classes": {c: k for c, k in first_classes.items() if k},
        }


@dataclass
class _Episode:
    task: Task
    env: CodeEnv
    messages: list[dict[str, str]]
    outcome: EpisodeOutcome
    signature: str = ""
    programs: set[str] = field(default_factory=set)


def repair(backend: ChatBackend, tasks: list[Task], ctx: EnvContext, settings: RepairSettings = RepairSettings(), *,
           log: JsonLog | None = None, metrics: Metrics | None = None, alert: AlertRule | None = None) -> RepairReport:
    """Run the agent on code tasks; `ctx` carries the sandbox and the environment's options (feedback
    length, instruction) - those of the model's training run, so the feedback reads as it did there."""
    if bad := [t.id for t in tasks if t.env != "code"]:
        raise ValueError(f"the repair agent takes code tasks; not: {', '.join(bad[:5])}")
    ctx = replace(ctx, max_turns=settings.repairs + 1)
    log = log or JsonLog(None)
    episodes = []
    for task in tasks:
        env = CodeEnv(ctx)
        episodes.append(_Episode(task, env, [{"role": "user", "content": env.reset(task)}], EpisodeOutcome(task.id)))
    active = list(episodes)
    for attempt in range(1, settings.repairs + 2):
        if not active:
            break
        started = time.perf_counter()
        completions = backend.chat([e.messages for e in active], max_tokens=settings.max_tokens,
                                   temperature=settings.temperature, seed=settings.seed + attempt)
        full = [e for e, c in zip(active, completions) if c.finish_reason == "context"]
        for e in full:
            e.outcome.ended = "context"
        running = [(e, c) for e, c in zip(active, completions) if c.finish_reason != "context"]
        steps = CodeEnv.step_batch([e.env for e, _ in running], [c.text for _, c in running])
        latency = time.perf_counter() - started
        for (e, completion), step in zip(running, steps):
            trial = step.info["attempt"]
            failure = classify(trial.exec_result, trial.example_result, step.info["hacking"])
            program = program_of(e.task, completion.text)  # what the sandbox ran
            stuck = (settings.stop_when_stuck and not step.done
                     and (failure.signature == e.signature or program in e.programs))
            e.signature, final = failure.signature, step.done or stuck
            e.programs.add(program)
            e.outcome.classes.append(failure.kind)
            if final:
                e.outcome.ended = ("solved" if step.info["success"] else "rejected" if failure.kind == "rejected"
                                   else "stuck" if stuck else "repairs")
            log.write({
                "event": "attempt", "time": time.time(), "model": backend.name, "task_id": e.task.id,
                "attempt": attempt, "program": program, "class": failure.kind, "message": failure.message,
                "traceback": failure.traceback, "visible_failures": failure.visible,
                "hidden_failed": failure.hidden_failed, "hidden_total": failure.hidden_total,
                "passed_fraction": step.info["passed"], "feedback": None if final else step.observation,
                "stuck": stuck, "final": final, "ended": e.outcome.ended or None, "latency_s": round(latency, 4),
                "prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
                "task": e.task.model_dump(exclude_defaults=True),
            })
            if metrics:
                metrics.attempts.labels(failure.kind).inc()
                metrics.attempt_seconds.observe(latency)
            if not final:
                e.messages += [{"role": "assistant", "content": completion.text},
                               {"role": "user", "content": step.observation or ""}]
        for e in active:
            if e.outcome.ended:
                _finish(e.outcome, metrics, alert)
        active = [e for e in active if not e.outcome.ended]
    return RepairReport([e.outcome for e in episodes])


def _finish(outcome: EpisodeOutcome, metrics: Metrics | None, alert: AlertRule | None) -> None:
    if metrics:
        metrics.episodes.labels("solved" if outcome.solved else "stuck" if outcome.ended == "stuck"
                                else "failed").inc()
    if alert:
        alert.observe(outcome.solved, task_id=outcome.task_id)
