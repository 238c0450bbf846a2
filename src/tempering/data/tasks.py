"""Task files, validated against `tempering.types.Task`: JSONL (one object per line), Parquet, or a local
Hugging Face `datasets` directory (`save_to_disk`; for a DatasetDict, the split's directory).

Rows may be tempering tasks, or verl-style rows taken as they are: `data_source` (the domain), `prompt` (chat
messages), `reward_model.ground_truth` and `extra_info`. A ground truth with test cases (`{"inputs",
"outputs", "fn_name"?}`, as in verl's code datasets) makes a code task; any other is an answer to match
(`env: answer`: `<answer>`, `\\boxed{}`, `####` or `Answer:`). `columns` renames a file's columns to task
fields first (`{prompt: question, answer: solution}`).

A malformed record is reported as `FILE:ROW: what is wrong`, so a user can fix a file of thousands of tasks.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tempering.errors import TaskFileError
from tempering.types import Task


def _describe(error: ValidationError) -> str:
    parts = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"])
        parts.append(f"{where}: {e['msg']}" if where else e["msg"])
    return "; ".join(parts)


def load_tasks(path: str | Path, columns: dict[str, str] | None = None) -> list[Task]:
    """Read a task file (JSONL, Parquet or a datasets directory), or a named task set (`humaneval`,
    `leetcode-easy`, ...: `tempering.data.benchmarks`). Raises TaskFileError naming the file and the line
    (row) of any bad record."""
    from tempering.data.benchmarks import BENCHMARKS

    if str(path) in BENCHMARKS and not Path(path).exists():
        try:
            return BENCHMARKS[str(path)]()
        except ValueError as e:
            raise TaskFileError(f"task set '{path}': {e}") from None
    path = Path(path)
    if not path.exists():
        raise TaskFileError(f"task file '{path}' does not exist")
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for lineno, record in _records(path):
        if not isinstance(record, dict):
            raise TaskFileError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        try:
            task = Task.model_validate(_task_fields(record, columns or {}, lineno))
        except ValidationError as e:
            raise TaskFileError(f"{path}:{lineno}: invalid task: {_describe(e)}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise TaskFileError(f"{path}:{lineno}: invalid task: {e}") from None
        if task.id in seen:
            raise TaskFileError(
                f"{path}:{lineno}: duplicate task id '{task.id}' (first on line {seen[task.id]})"
            )
        seen[task.id] = lineno
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"task file '{path}' holds no tasks")
    return tasks


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number from 1, record) of a JSONL file, a Parquet file or a datasets directory."""
    if path.is_dir() or path.suffix == ".parquet":
        try:
            import pyarrow.ipc
            import pyarrow.parquet
        except ImportError:
            raise TaskFileError(f"task file '{path}': reading Parquet / datasets needs pyarrow") from None
        if path.is_dir():
            files = sorted(path.glob("*.arrow"))
            if not files:
                raise TaskFileError(
                    f"task directory '{path}' has no *.arrow files (a datasets save_to_disk "
                    "directory; for a DatasetDict name the split's directory)"
                )
            rows = [r for f in files for r in pyarrow.ipc.open_stream(f).read_all().to_pylist()]
        else:
            try:
                rows = pyarrow.parquet.read_table(path).to_pylist()
            except pyarrow.ArrowException as e:
                raise TaskFileError(f"task file '{path}': not a readable Parquet file ({e})") from None
        yield from enumerate(rows, start=1)
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(
                    f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None


def _task_fields(record: dict[str, Any], columns: dict[str, str], row: int) -> dict[str, Any]:
    """A record's task fields: `columns` (task field -> file column) applied, verl-style rows converted."""
    record = {
        **{k: v for k, v in record.items() if k not in columns.values()},
        **{field: record[column] for field, column in columns.items() if column in record},
    }
    if "reward_model" not in record:
        return record
    messages, truth = record["prompt"], (record["reward_model"] or {}).get("ground_truth")
    if truth is None:
        raise ValueError("reward_model.ground_truth is missing")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    extra = dict(record.get("extra_info") or {})
    source = str(record.get("data_source") or "verl")
    task = {
        "id": str(extra.get("id", f"{source}-{extra.get('index', row - 1)}")),
        "domain": source,
        "prompt": "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "user")),
        "metadata": {"extra_info": extra, "data_source": source},
    }
    if isinstance(truth, str) and truth.lstrip().startswith("{"):
        try:
            truth = json.loads(truth)
        except json.JSONDecodeError:
            pass
    if isinstance(truth, dict) and "inputs" in truth and "outputs" in truth:
        name = truth.get("fn_name")
        tests = [
            {"input": i if isinstance(i, list) else [i], "output": o} if name else {"stdin": i, "stdout": o}
            for i, o in zip(truth["inputs"], truth["outputs"], strict=True)
        ]
        return {**task, "env": "code", "entry_point": name, "tests": tests}
    return {**task, "env": "answer", "answer": truth, "reference_solution": str(truth)}


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


def hold_out_functions(tasks: list[Task], n: int, seed: int) -> tuple[list[Task], list[Task]]:
    """(the rest, `n` tasks of distinct functions drawn at random): every task of a drawn function leaves
    the rest, so the `n` are functions the rest never shows (SFT's validation tasks)."""
    keys = sorted({function_key(t) for t in tasks})
    if len(keys) < 2:
        raise ValueError(
            f"holding out validation functions needs 2 or more training functions, not {len(keys)}"
        )
    held_keys = set(random.Random(f"held-out functions:{seed}").sample(keys, min(n, len(keys) - 1)))
    held: dict[str, Task] = {}
    rest: list[Task] = []
    for task in tasks:
        key = function_key(task)
        if key not in held_keys:
            rest.append(task)
        else:
            held.setdefault(key, task)  # a function's first task
    return rest, list(held.values())


def spread_over_domains(tasks: list[Task], n: int) -> list[Task]:
    """`n` tasks taken a domain at a time, in turn (domains in order of first appearance, each domain's tasks
    in their order): the validation subset, so a held-out list grouped by domain (reasoning-gym's) is
    validated in every domain. A list that already takes its domains in turn is cut unchanged."""
    by_domain: dict[str, list[Task]] = {}
    for task in tasks:
        by_domain.setdefault(task.domain, []).append(task)
    rounds = itertools.chain.from_iterable(itertools.zip_longest(*by_domain.values()))
    return [t for t in rounds if t is not None][:n]


def sft_completion(task: Task) -> str:
    """The text the model should write after the prompt, derived from the reference solution.

    If the reference repeats the prompt, the rest of it; if it repeats only the prompt's first line (the
    `def` line of a function-synthesis task), the body after it; otherwise the whole reference.
    """
    ref = task.reference_solution or ""
    if ref.startswith(task.prompt):
        return ref[len(task.prompt) :]
    first = task.prompt.split("\n", 1)[0]
    if first and ref.startswith(first + "\n"):
        return ref[len(first) + 1 :]
    return ref
