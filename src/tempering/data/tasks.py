"""Task files: one JSON object per line, validated against `tempering.types.Task`.

A malformed record is reported as `FILE:LINE: what is wrong`, so a user can fix a file of thousands of tasks.
"""

from __future__ import annotations

import json
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
