"""Supervised warm-up data for episodes: what a competent agent's transcript looks like, per environment.

- code: the reference solution; for a share of the tasks (`sft.repair_fraction`) a *repair* transcript
  instead - a wrong first attempt (the body of another function of the same template, a realistic near
  miss), the feedback the environment really gives for it, then the reference. Only the reference is
  trained on: the model learns to read feedback and fix, never to write the wrong attempt.
- tool: the reference actions played against the simulated services, retrying what the flaky API fails.
- answer, reasoning_gym: the reference answer.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tempering.data.tasks import sft_completion
from tempering.envs import EnvContext
from tempering.envs.code import CodeEnv
from tempering.envs.tools import reference_episode
from tempering.training.sft import Transcript
from tempering.types import Task


def repair_transcript(task: Task, wrong: str, ctx: EnvContext) -> Transcript | None:
    """[(wrong attempt, its feedback, not trained), (reference, -, trained)], or None when the wrong attempt
    passes (an equivalent function)."""
    env = CodeEnv(replace(ctx, max_turns=2))
    env.reset(task)
    step = env.step(wrong)
    if step.done:
        return None
    return [(wrong, step.observation, False), (sft_completion(task), None, True)]


def sft_transcripts(
    tasks: list[Task], ctx: EnvContext, *, repair_fraction: float = 0.0, seed: int = 0
) -> list[tuple[Task, Transcript]]:
    """One transcript per task that has a reference (deterministic in `seed`)."""
    rng = random.Random(f"transcripts:{seed}")
    bodies: dict[str, list[str]] = {}
    for t in tasks:
        if t.env == "code" and "template" in t.metadata and "body" in t.metadata:
            bodies.setdefault(t.metadata["template"], []).append(t.metadata["body"])
    jobs: list[tuple[Task, str | None]] = []
    for t in tasks:
        wrong = None
        if t.env == "code" and rng.random() < repair_fraction and "template" in t.metadata:
            others = [b for b in bodies[t.metadata["template"]] if b != t.metadata["body"]]
            wrong = rng.choice(others) + "\n" if others else None
        jobs.append((t, wrong))

    def make(job: tuple[Task, str | None]) -> Transcript | None:
        task, wrong = job
        if task.env == "tool":
            turns = reference_episode(task, ctx, seed=rng_seed(seed, task.id))
            return [(action, obs, True) for action, obs in turns]
        if not task.reference_solution:
            return None
        if wrong is not None:
            repaired = repair_transcript(task, wrong, ctx)
            if repaired is not None:
                return repaired
        return [(sft_completion(task), None, True)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        made = list(pool.map(make, jobs))
    return [(t, tr) for (t, _), tr in zip(jobs, made) if tr is not None]


def rng_seed(seed: int, task_id: str) -> int:
    return random.Random(f"{seed}:{task_id}").getrandbits(31)


def transcript_text(task: Task, transcript: Transcript) -> str:
    """The plain text of a transcript (what the tiny model's tokenizer is trained on)."""
    return task.prompt + "".join(action + (obs or "") for action, obs, _ in transcript)
