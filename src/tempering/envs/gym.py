"""reasoning-gym adapter: ~100 procedural task families with verifiers (`pip install 'tempering[gym]'`).

`gym_tasks` turns dataset entries into tasks (one domain per dataset; the entry is kept in the task's
metadata, so a task file scores without the generator's state) and `GymEnv` scores an answer with the
dataset's own verifier. What the adapter fixes (measured on reasoning-gym 0.1.25 over all 106 datasets):
`composite` is a mixer, not a task family, and is left out; `list_functions` draws from the global
`random` module, so it is seeded per entry; `arc_agi`/`rearc` compare tuples that JSON turns into lists;
`game_of_life_halting`'s verifier gives full credit to any non-empty answer and is replaced by an exact
match; the base scorer that 33 datasets keep (gcd, syllogism, course_schedule, ...) gives
len(oracle) / len(answer) to any answer containing the oracle - a policy learned to answer "21" to every
GCD - and scores exact matches only here; a verifier that raises on a malformed answer scores 0. Five
generators (`HASH_DEPENDENT`) iterate over sets of strings, so their tasks depend on the process's string
hashing: they are generated in a child process with PYTHONHASHSEED=0, so every run (a control arm, another
seed, a pass-rate survey) gets the same tasks for the same seed.

Verifiers run in the sandbox, never in this process: several evaluate the answer as Python (`eval` in
string_insertion, spiral_matrix, binary_matrix, n_queens; sympy's `parse_expr` in countdown, puzzle24,
the integration and polynomial tasks), so a crafted answer would otherwise run code on the host. A
dedicated pool of sandbox workers (`verifier_pool`, started on the first gym score) imports reasoning-gym
read-only once per worker (`sandboxed/tempering_gym_verifier.py`), and every answer is scored in a
forked execution of its own, so one answer cannot change another's score. A verifier that crashes,
times out, or whose execution tried something flagged (a process, a signal, the network, its result
channel) scores 0; inside, only plain expressions may be compiled while a verifier runs, so an answer
cannot forge its own score either. Only game_of_life_halting's exact match, written here, runs in this
process.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import site
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tempering.config_sections import SandboxSection
from tempering.envs.answer import AnswerEnv, answers_match
from tempering.envs.base import register
from tempering.errors import SandboxError
from tempering.sandbox import ExecRequest, LocalSandbox, Sandbox, limits_of, open_sandbox
from tempering.sandbox.pool import default_python
from tempering.types import Task

EXCLUDED = {"composite"}
"""Datasets that are not task families."""
HASH_DEPENDENT = {
    "isomorphic_strings",
    "knight_swap",
    "polynomial_multiplication",
    "ransom_note",
    "word_ladder",
}
"""Generators whose tasks depend on PYTHONHASHSEED (they iterate over sets of strings)."""
HOST_CHECKED = {"game_of_life_halting"}
"""Datasets whose own verifier is replaced by the exact match written here (run in this process)."""
VERIFIER_DIR = Path(__file__).with_name("sandboxed")
VERIFIER_MODULE = "tempering_gym_verifier"
VERIFIER_CODE = f"from {VERIFIER_MODULE} import score\n"
VERIFIER_SANDBOX = SandboxSection(timeout_s=5.0, cpu_s=5.0, memory_mb=1024, max_output_bytes=8192)
"""The verifier pool's sandbox (its workers, interpreter and isolation are set when it opens)."""
VERIFIER_LIMITS = limits_of(VERIFIER_SANDBOX)
"""Per answer (on top of the preloaded server's memory): a verifier is done in milliseconds; an answer
that keeps sympy busy for longer (`9**9**9`) is a wrong answer."""
MAX_ANSWER_CHARS = 100_000
"""Longer answers score 0 without being verified."""
TRUSTED_FLAGS = {"file_outside_scratch"}
"""Flags a verifier raises by itself (reading its package's data); any other makes the score 0."""


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(
            "reasoning-gym is not installed: pip install 'tempering[gym]' (or reasoning-gym)"
        ) from None
    return reasoning_gym


def gym_datasets() -> list[str]:
    """Every registered reasoning-gym dataset usable as a domain."""
    return sorted(set(_rg().factory.DATASETS) - EXCLUDED)


# ------------------------------------------------------------------------------------- verifier pool

_pools: dict[tuple[str, int], Sandbox] = {}
_pools_lock = threading.Lock()


def verifier_pool(isolation: str = "auto", workers: int = 2) -> Sandbox:
    """The process-wide pool that runs reasoning-gym's verifiers, started on first use (each worker
    imports reasoning-gym once: ~2-4 s). Raises SandboxError when its workers cannot load the verifiers."""
    key = (isolation, max(1, workers))
    with _pools_lock:
        if key not in _pools:
            python, paths = verifier_python(), import_paths()
            section = VERIFIER_SANDBOX.model_copy(
                update={"workers": key[1], "python": python, "isolation": isolation}
            )
            try:
                _pools[key] = open_sandbox(section, python_path=paths, preload=(VERIFIER_MODULE,))
            except SandboxError as e:
                raise SandboxError(
                    f"reasoning-gym verifiers must run in the sandbox, and its workers "
                    f"({python}) cannot load them from {list(paths)}: {e}"
                ) from None
        return _pools[key]


def verifier_python() -> str:
    """The sandbox's interpreter when it is this Python's version (reasoning-gym's compiled dependencies
    were installed for this version), else this interpreter."""
    python = default_python()
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=20,
            env={},
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return python if out == [str(v) for v in sys.version_info[:2]] else os.path.realpath(sys.executable)


def import_paths() -> tuple[str, ...]:
    """What the verifier workers import from: the verifier module's directory, reasoning-gym's install
    directory and this environment's site-packages (reasoning-gym's dependencies)."""
    paths = [VERIFIER_DIR, Path(_rg().__file__).resolve().parent.parent, *map(Path, site.getsitepackages())]
    unique: list[str] = []
    for path in paths:
        if path.is_dir() and str(path) not in unique:
            unique.append(str(path))
    return tuple(unique)


# ------------------------------------------------------------------------------------------ scoring


def score_gym_answers(items: list[tuple[Task, str]], pool: Sandbox | None = None) -> list[float]:
    """The dataset's verifier on each (task, answer), in [0, 1]; one sandboxed execution per answer, run
    in parallel across the pool's workers (`pool`: default `verifier_pool()`)."""
    scores: list[float] = [0.0] * len(items)
    requests: list[ExecRequest] = []
    slots: list[int] = []
    for i, (task, answer) in enumerate(items):
        name, entry = task.metadata["dataset"], task.metadata["entry"]
        if name in HOST_CHECKED:
            scores[i] = float(answers_match(answer, entry["answer"]))
        elif len(answer) <= MAX_ANSWER_CHARS:
            config = json.dumps(task.metadata.get("config") or {}, sort_keys=True)
            requests.append(
                ExecRequest(
                    code=VERIFIER_CODE,
                    entry_point="score",
                    calls=[[name, config, entry, answer]],
                    limits=VERIFIER_LIMITS,
                )
            )
            slots.append(i)
    if requests:
        raw = (pool or verifier_pool()).execute_many(requests)
        for i, response in zip(slots, raw):
            scores[i] = verified_score(response)
    return scores


def verified_score(response: dict[str, Any]) -> float:
    """The score in a verifier execution's response; 0 unless it ran cleanly to a plain number."""
    calls = response.get("calls") or [None]
    call = calls[0]
    if response.get("status") != "ok" or set(response.get("flags") or ()) - TRUSTED_FLAGS:
        return 0.0
    if not isinstance(call, dict) or not call.get("ok") or not isinstance(call.get("value"), str):
        return 0.0
    if len(call["value"]) > 40:  # the repr of a float; never parsed beyond that
        return 0.0
    try:
        value = float(call["value"])
    except ValueError:
        return 0.0
    return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0


def score_gym_answer(task: Task, answer: str, pool: Sandbox | None = None) -> float:
    """The dataset's verifier on `answer`, in [0, 1] (see `score_gym_answers`)."""
    return score_gym_answers([(task, answer)], pool)[0]


@register
class GymEnv(AnswerEnv):
    """An answer-matching episode judged by the dataset's verifier (partial credit allowed; success = 1.0)."""

    kind = "reasoning_gym"

    def judge(self, answer: str) -> tuple[float, str]:
        local = self.ctx.sandbox if isinstance(self.ctx.sandbox, LocalSandbox) else None
        pool = verifier_pool(local.backend, local.size) if local is not None else None
        return score_gym_answer(self.task, answer, pool), "incorrect"


def gym_tasks(
    datasets: list[str] | None,
    per_domain_train: int,
    per_domain_heldout: int,
    seed: int,
    config: dict[str, dict[str, Any]] | None = None,
    max_prompt_chars: int = 600,
) -> tuple[list[Task], list[Task]]:
    """Tasks from each dataset (None = all); one domain per dataset. Entries whose question is longer than
    `max_prompt_chars` are skipped (a small model's context), and held-out questions that also occur in
    training are dropped. Raises ValueError naming an unknown dataset."""
    rg = _rg()
    names = gym_datasets() if datasets is None else list(datasets)
    unknown = [n for n in names if n not in rg.factory.DATASETS or n in EXCLUDED]
    if unknown:
        raise ValueError(
            f"unknown reasoning-gym dataset(s) {unknown}; e.g. {', '.join(gym_datasets()[:8])}, ..."
        )
    args = [names, per_domain_train, per_domain_heldout, seed, config or {}, max_prompt_chars]
    if sys.flags.hash_randomization and HASH_DEPENDENT & set(names):
        return _generate_in_child(args)
    return _generate(*args)


def _generate(
    names: list[str],
    per_domain_train: int,
    per_domain_heldout: int,
    seed: int,
    config: dict[str, dict[str, Any]],
    max_prompt_chars: int,
) -> tuple[list[Task], list[Task]]:
    rg = _rg()
    train: list[Task] = []
    heldout: list[Task] = []
    # Some generators write scratch files into the working directory (temp_parameters.txt): not the user's.
    with tempfile.TemporaryDirectory(prefix="tempering-gym-") as scratch, contextlib.chdir(scratch):
        for name in names:
            want = per_domain_train + per_domain_heldout
            picked = _entries(rg, name, config.get(name, {}), want, seed, max_prompt_chars)
            cut = min(per_domain_train, max(1, len(picked) - per_domain_heldout)) if picked else 0
            train += picked[:cut]
            heldout += picked[cut:]
    return train, heldout


def _generate_in_child(args: list) -> tuple[list[Task], list[Task]]:
    """`_generate(*args)` in a child process whose string hashing is fixed (PYTHONHASHSEED=0); the tasks
    come back through a file (generators print to stdout)."""
    with tempfile.TemporaryDirectory(prefix="tempering-gym-") as tmp:
        out = Path(tmp) / "tasks.json"
        code = "import sys; from tempering.envs.gym import _child; _child(sys.argv[1], sys.argv[2])"
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(args), str(out)],
            env={**os.environ, "PYTHONHASHSEED": "0"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode != 0 or not out.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"reasoning-gym: generating tasks in a child process failed: {last}")
        train, heldout = json.loads(out.read_text())
    return [Task.model_validate(t) for t in train], [Task.model_validate(t) for t in heldout]


def _child(args: str, out: str) -> None:
    train, heldout = _generate(*json.loads(args))
    Path(out).write_text(json.dumps([[t.model_dump() for t in train], [t.model_dump() for t in heldout]]))


def _entries(
    rg, name: str, kwargs: dict[str, Any], want: int, seed: int, max_prompt_chars: int
) -> list[Task]:
    """Up to `want` tasks of one dataset, distinct questions no longer than `max_prompt_chars`."""
    ds = rg.create_dataset(name, seed=seed, size=4 * want, **kwargs)
    picked: list[Task] = []
    seen: set[str] = set()
    for i in range(4 * want):
        if len(picked) == want:
            break
        random.seed(f"{seed}:{name}:{i}")  # list_functions draws from the global generator
        entry = json.loads(json.dumps(ds[i], default=str))
        question = entry["question"]
        if len(question) > max_prompt_chars or question in seen:
            continue
        seen.add(question)
        picked.append(
            Task(
                id=f"{name}-{i}",
                domain=name,
                env="reasoning_gym",
                prompt=f"{question}\nAnswer: ",
                answer=entry.get("answer"),
                reference_solution=entry.get("answer"),
                metadata={"dataset": name, "entry": entry, "config": kwargs},
            )
        )
    return picked
