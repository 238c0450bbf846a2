"""Task files: one JSON object per line, validated against `tempering.types.Task`.

A malformed record is reported as `FILE:LINE: what is wrong`, so a user can fix a file of thousands of tasks.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from tempering.errors import TaskFileError
from tempering.types import Task


def _describe(error: ValidationError) -> str:
    parts = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"])
        parts.append(f"{where}: {e['msg']}" if where else e["msg"])
    return "; ".join(parts)


def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file. Raises TaskFileError naming file and line for any bad record."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"task file '{path}' does not exist")
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise TaskFileError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            try:
                task = Task.model_validate(record)
            except ValidationError as e:
                raise TaskFileError(f"{path}:{lineno}: invalid task: {_describe(e)}") from None
            if task.id in seen:
                raise TaskFileError(f"{path}:{lineno}: duplicate task id '{task.id}' (first on line {seen[task.id]})")
            seen[task.id] = lineno
            tasks.append(task)
    if not tasks:
        raise TaskFileError(f"task file '{path}' holds no tasks")
    return tasks


def save_tasks(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL (atomically: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(task.model_dump_json(exclude_defaults=True) + "\n")
    tmp.replace(path)
    return path


def function_key(task: Task) -> str:
    """What makes two tasks 'the same function': the generator's template and body, else the task id."""
    meta = task.metadata
    if "template" in meta and "body" in meta:
        return f"{meta['template']}\n{meta['body']}"
    return task.id


def split_stages(tasks: list[Task], sft_fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """(SFT tasks, RL tasks). With `sft_fraction` < 1 the two hold disjoint functions: SFT learns from the
    reference solutions of some functions, RL learns from test outcomes on functions SFT never saw (as in
    practice, where RL prompts are not the SFT data). 1.0 = both stages use every task."""
    if sft_fraction >= 1.0:
        return tasks, tasks
    task_keys = [function_key(t) for t in tasks]
    keys = sorted(set(task_keys))
    random.Random(f"stages:{seed}").shuffle(keys)
    sft_keys = set(keys[: round(len(keys) * sft_fraction)])
    sft = [t for t, k in zip(tasks, task_keys) if k in sft_keys]
    rl = [t for t, k in zip(tasks, task_keys) if k not in sft_keys]
    if not sft or not rl:
        raise ValueError(f"data.sft_fraction={sft_fraction} leaves no tasks for one of the stages")
    return sft, rl
