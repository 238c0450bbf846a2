"""The repair agent: write code, run it in the sandbox, read what went wrong, try again.

It is the episode driver of multi-turn RL (`rollout.episodes.run_episodes`) with three additions: a stop
rule, an attempt log and monitoring. Each task is one episode of the code environment (`envs.code.CodeEnv`:
the same sandbox batch, the same tests, the same feedback text - one line, clipped head and tail), up to
`repairs` attempts after the first, on any engine (`inference.engine.make_engine`: a local model, or an
OpenAI-compatible server over HTTP). The stop rule (`StopRule`) classifies each attempt
(`failures.classify`) and ends an episode that is stuck (OpenHands' rule, simplified: the new attempt fails
with the same error as the one before, or repeats an earlier program - asking again would only repeat it)
or was rejected by a reward-hacking guard. A model trained with `configs/code-repair.yaml` is the agent's
model as it is: its episodes here are token for token those of its training.

Every attempt is a JSON line in the log (`ATTEMPT_FIELDS`), and counts in the metrics.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from tempering.agent.failures import FAILURE_CLASSES, Failure, classify
from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.envs import EnvContext
from tempering.envs.code import program_of
from tempering.inference.engine import Engine
from tempering.rollout.episodes import run_episodes
from tempering.types import Episode, Task

ATTEMPT_FIELDS = (
    "event",
    "time",
    "model",
    "task_id",
    "attempt",
    "program",
    "class",
    "message",
    "traceback",
    "visible_failures",
    "hidden_failed",
    "hidden_total",
    "passed_fraction",
    "feedback",
    "stuck",
    "final",
    "ended",
    "latency_s",
    "prompt_tokens",
    "completion_tokens",
    "task",
)
"""One line of the attempt log. `task` is the task itself (prompt, entry point, tests), so that
`tempering data from-logs` can rebuild it; `ended` (on the final attempt) is solved, stuck, repairs
(none left), context (the model's context is full) or rejected."""


@dataclass(frozen=True)
class RepairSettings:
    repairs: int = 3
    """Attempts after the first one (aider allows 3 reflections)."""
    stop_when_stuck: bool = True
    greedy: bool = True
    """Greedy decoding; else the engine's sampling distribution."""
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


@dataclass
class RepairReport:
    episodes: list[EpisodeOutcome]

    def summary(self) -> dict[str, float | int | dict]:
        """The evaluation's own names: `pass@1` of the final attempt, `first_turn_pass@1` of the first."""
        n = max(1, len(self.episodes))
        first_classes = {c: sum(e.classes[:1] == [c] for e in self.episodes) for c in FAILURE_CLASSES}
        return {
            "tasks": len(self.episodes),
            "first_turn_pass@1": sum(e.classes[:1] == ["passed"] for e in self.episodes) / n,
            "pass@1": sum(e.solved for e in self.episodes) / n,
            "stuck_rate": sum(e.ended == "stuck" for e in self.episodes) / n,
            "attempts/mean": sum(len(e.classes) for e in self.episodes) / n,
            "ended": {
                k: sum(e.ended == k for e in self.episodes)
                for k in ("solved", "stuck", "repairs", "context", "rejected")
            },
            "first_attempt_classes": {c: k for c, k in first_classes.items() if k},
        }


class StopRule:
    """`run_episodes`' stop rule: classify the newest attempt; end the episode when it was rejected by a
    guard, or (`stuck`) when its failure signature equals the previous attempt's or its program was tried
    before. Keeps every attempt's classification for the log."""

    def __init__(self, stuck: bool = True):
        self.stuck = stuck
        self.failures: dict[int, list[Failure]] = {}

    def classify(self, e: Episode) -> Failure:
        seen = self.failures.setdefault(id(e), [])
        while len(seen) < len(e.turns):
            turn = e.turns[len(seen)]
            seen.append(classify(turn.attempt.exec_result, turn.attempt.example_result, turn.hacking))
        return seen[-1]

    def __call__(self, e: Episode) -> str | None:
        failure = self.classify(e)
        if failure.kind == "rejected":
            return "rejected"
        programs = [program_of(e.task, t.action) for t in e.turns]
        earlier = self.failures[id(e)][:-1]
        if self.stuck and (
            (earlier and earlier[-1].signature == failure.signature) or programs[-1] in programs[:-1]
        ):
            return "stuck"
        return None


def repair(
    engine: Engine,
    tasks: list[Task],
    ctx: EnvContext,
    settings: RepairSettings = RepairSettings(),
    *,
    max_context: int = 1024,
    chat: str = "auto",
    name: str = "model",
    log: JsonLog | None = None,
    metrics: Metrics | None = None,
    alert: AlertRule | None = None,
) -> RepairReport:
    """Run the agent on code tasks; `ctx` carries the sandbox and the environment's options (feedback
    length, instruction) - those of the model's training run, so the feedback reads as it did there."""
    if bad := [t.id for t in tasks if t.env != "code"]:
        raise ValueError(f"the repair agent takes code tasks; not: {', '.join(bad[:5])}")
    rule, rounds = StopRule(settings.stop_when_stuck), []
    episodes = run_episodes(
        engine,
        tasks,
        replace(ctx, max_turns=settings.repairs + 1),
        group_size=1,
        max_context=max_context,
        greedy=settings.greedy,
        chat=chat,
        seed=settings.seed,
        generator=torch.Generator().manual_seed(settings.seed),
        timer=_rounds(rounds),
        stop=rule,
    )
    log, outcomes = log or JsonLog(None), []
    for e in episodes:
        rule.classify(e)  # the last attempt too (the rule is asked only while more may follow)
        outcome = _record(e, rule.failures[id(e)], rounds, log, name, metrics)
        if alert:
            alert.observe(outcome.solved, task_id=outcome.task_id)
        outcomes.append(outcome)
    return RepairReport(outcomes)


def _record(
    e: Episode, failures: list[Failure], rounds: list[float], log: JsonLog, name: str, metrics: Metrics | None
) -> EpisodeOutcome:
    """An episode's outcome; each of its attempts written to the log and counted in the metrics."""
    outcome = EpisodeOutcome(e.task.id)
    for k, (turn, failure) in enumerate(zip(e.turns, failures)):
        outcome.classes.append(failure.kind)
        if k == len(e.turns) - 1:
            outcome.ended = _ended(e, turn.success, failure)
        latency = rounds[k] if k < len(rounds) else 0.0
        log.write(_attempt_line(e, k, failure, model=name, ended=outcome.ended or None, latency=latency))
        if metrics:
            metrics.attempts.labels(failure.kind).inc()
            metrics.attempt_seconds.observe(latency)
    if metrics:
        metrics.episodes.labels(
            "solved" if outcome.solved else "stuck" if outcome.ended == "stuck" else "failed"
        ).inc()
    return outcome


def _ended(e: Episode, success: bool, last: Failure) -> str:
    """Why the episode ended, from its last attempt (`ATTEMPT_FIELDS`)."""
    if success:
        return "solved"
    if last.kind == "rejected":
        return "rejected"
    return e.stopped or ("context" if e.truncated else "repairs")


def _attempt_line(
    e: Episode, k: int, failure: Failure, *, model: str, ended: str | None, latency: float
) -> dict:
    """The log line (`ATTEMPT_FIELDS`) of the episode's attempt `k`."""
    turn, final = e.turns[k], k == len(e.turns) - 1
    return {
        "event": "attempt",
        "time": time.time(),
        "model": model,
        "task_id": e.task.id,
        "attempt": k + 1,
        "program": program_of(e.task, turn.action),
        "class": failure.kind,
        "message": failure.message,
        "traceback": failure.traceback,
        "visible_failures": failure.visible,
        "hidden_failed": failure.hidden_failed,
        "hidden_total": failure.hidden_total,
        "passed_fraction": turn.passed,
        "feedback": turn.observation,
        "stuck": final and e.stopped == "stuck",
        "final": final,
        "ended": ended,
        "latency_s": round(latency, 4),
        "prompt_tokens": len(e.prompt_ids) + e.turn_ends[k] + 1 - turn.tokens,
        "completion_tokens": turn.tokens,
        "task": e.task.model_dump(exclude_defaults=True),
    }


def _rounds(seconds: list[float]):
    """A `run_episodes` timer that records each round's time (its generation and its execution): the
    latency of the attempts made in that round."""
    state = {"gen": None}

    @contextmanager
    def timer(name: str):
        started = time.perf_counter()
        yield
        took = time.perf_counter() - started
        if name == "gen":
            state["gen"] = took
        elif name == "reward":
            seconds.append((state["gen"] or 0.0) + took)

    return timer
