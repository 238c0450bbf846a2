"""Production error logs -> sandbox tasks (`tempering data from-logs LOGS... --out tasks.jsonl`).

Two kinds of JSONL records are read (a file may mix them):

* the repair agent's attempt log (`tempering repair --log`, `agent.repair.ATTEMPT_FIELDS`): each record
  carries its task, tests included; the failing attempts become the logged failures, and an attempt that
  passed serves as the reference when the task has none;
* a user's own error records, one per failure:

      {"prompt": "...",          the request the model answered (the task text)       required
       "code": "...",            the program that failed                               required
       "entry_point": "f",       the function the test calls (omit for a stdin/stdout program)
       "input": [1, 2],          the failing call's arguments (a list, one item per argument) } or
                                 "stdin": "...", or "tests": [...]
       "expected": 3,            its expected result / stdout (TestCase objects, tempering's schema)
       "error": "...",           what happened (kept in the task's metadata)           optional
       "reference": "...",       a program known to be right                           optional
       "id": "...", "domain": "..."                                                     optional}

Records of the same request (same prompt and entry point) merge into one task: their test cases are
pooled (each distinct one once) and their failing programs kept; identical tasks are written once. Two
records that give one input two different expected values cannot both be right: with a reference the
sandbox check below decides, without one both test cases are left out (and a task left with none is
dropped, with that reason) - no program could pass such a task. Each
task is checked in the sandbox before it is written: its reference, when known, passes every test, and
at least one logged failing program fails one; a task that does not pass these checks is dropped, with
the reason counted. Of a request's failing programs, each distinct one is run once and only the first
`MAX_FAILING` (5; `--max-failing`): thirty logged infinite loops cost five timeouts, not thirty. The
result is an evaluation set for `tempering eval` and an RL task file for `tempering train`
(`data.train_file`).

A record that cannot be read - not UTF-8, not JSON, NaN or Infinity (no JSON value: write null or a
string), nested deeper than `MAX_DEPTH`, a field of the wrong type - is an error naming its file and
line, raised before anything runs.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tempering.errors import TaskFileError
from tempering.types import Task, TestCase

MAX_FAILING = 5
"""Distinct failing programs of one request run in the sandbox (the first ones logged)."""
MAX_DEPTH = 100
"""Deepest nesting of lists and objects in a record; JSON and validation recurse on deeper ones."""


@dataclass
class _Entry:
    """One request seen in the logs: what a task is built from."""

    prompt: str
    entry_point: str | None
    domain: str
    tests: dict[str, TestCase] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reference: str | None = None
    examples: list[TestCase] = field(default_factory=list)
    """The visible examples of the prompt (agent logs): the feedback and the hard-coding guard use them."""

    def add_test(self, test: TestCase) -> None:
        self.tests.setdefault(test.model_dump_json(exclude={"name"}), test)


@dataclass
class LogTasks:
    tasks: list[Task]
    records: int
    dropped: Counter


def read_records(paths: list[str | Path]) -> list[tuple[str, dict]]:
    """(where, record) for every line of every log; a line that is not a JSON object is an error naming
    the file and line (raised before anything is built)."""
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise TaskFileError(f"log file '{path}' does not exist")
        try:
            lines = path.read_bytes().splitlines()
        except OSError as e:
            raise TaskFileError(f"log file '{path}' cannot be read ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = _parse(line)
            except ValueError as e:
                raise TaskFileError(f"{path}:{n}: {e}") from None
            out.append((f"{path}:{n}", record))
    return out


def _parse(line: bytes) -> dict:
    """One log line as a JSON object; a ValueError says what is wrong with it."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start + 1} of the line)") from None
    try:
        record = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(record, dict):
        raise ValueError("a log record is a JSON object")
    if _depth(record) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return record


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value (write null, or the value as a string)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a number")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of lists and objects (an object of scalars: 1), without recursion; stops past MAX_DEPTH."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(x, depth + 1) for x in (item.values() if isinstance(item, dict) else item)]
    return deepest


def collect(records: list[tuple[str, dict]]) -> dict[tuple[str, str | None], _Entry]:
    """Group records by request; raises TaskFileError (file:line) on a record of neither schema."""
    entries: dict[tuple[str, str | None], _Entry] = {}

    def entry(prompt: str, entry_point: str | None, domain: str) -> _Entry:
        key = (" ".join(prompt.split()), entry_point)
        return entries.setdefault(key, _Entry(prompt, entry_point, domain))

    for where, r in records:
        try:
            if r.get("event") == "attempt":
                task = Task.model_validate(r["task"])
                e = entry(task.prompt, task.entry_point, task.domain)
                for t in task.tests:
                    e.add_test(t)
                e.reference = e.reference or task.reference_solution
                e.examples = e.examples or task.examples
                program = _field(r, "program", str, required=True)
                if r.get("class") == "passed":
                    e.reference = e.reference or program
                else:
                    e.failing.append(program)
                    e.errors.append(_field(r, "message", str) or _field(r, "class", str) or "")
            elif r.get("event") is None:  # (the server's request log and other events carry no task)
                _user_record(r, entry)
        except (KeyError, TypeError, ValueError, ValidationError) as ex:
            raise TaskFileError(f"{where}: not an agent attempt or an error record ({_why(ex)})") from None
    return entries


def _field(r: dict[str, Any], key: str, kind: type, *, required: bool = False, default: Any = None) -> Any:
    """`r[key]`, which must be a `kind` (absent or null: `default`, or a KeyError when required)."""
    value = r[key] if required else r.get(key)
    if value is None and not required:
        return default
    if not isinstance(value, kind):
        raise ValueError(f"'{key}' must be a {_KINDS[kind]}, not {type(value).__name__}")
    return value


_KINDS = {str: "string", list: "list"}


def _why(ex: Exception) -> str:
    if isinstance(ex, KeyError):
        return f"missing field {ex}"
    if isinstance(ex, ValidationError):
        err = ex.errors()[0]
        where = ".".join(map(str, err["loc"]))
        return f"{ex.title}{' field ' + where if where else ''}: {err['msg']}"
    return str(ex).splitlines()[0]


def _user_record(r: dict[str, Any], entry) -> None:
    code = _field(r, "code", str, required=True)
    e = entry(
        _field(r, "prompt", str, required=True),
        _field(r, "entry_point", str),
        _field(r, "domain", str, default="logs"),
    )
    for t in _field(r, "tests", list, default=[]):
        e.add_test(TestCase.model_validate(t))
    if "expected" in r:
        if "input" in r:
            e.add_test(TestCase(input=_arguments(r["input"]), output=r["expected"]))
        elif "stdin" in r:
            e.add_test(TestCase(stdin=_field(r, "stdin", str, required=True), stdout=str(r["expected"])))
        else:
            raise ValueError("'expected' needs the failing 'input' (a call's arguments) or 'stdin'")
    e.failing.append(code)
    e.errors.append(str(r.get("error", "")))
    if reference := _field(r, "reference", str):
        e.reference = e.reference or reference


def _arguments(value: Any) -> list:
    """A record's "input": the call's arguments, a list. Anything else is refused rather than guessed at
    (a string would otherwise become one argument per character)."""
    if not isinstance(value, list):
        raise ValueError(
            f"'input' is the call's arguments, a list ([{json.dumps(value)[:40]}] for one argument), "
            f"not {type(value).__name__}"
        )
    return value


def _conflicting(tests: dict[str, TestCase]) -> set[str]:
    """Keys of the test cases whose input (call arguments or stdin) another case expects something else of."""

    def given(t: TestCase) -> str:
        return json.dumps([t.input, t.stdin], sort_keys=True, default=str)

    outcomes: dict[str, set[str]] = {}
    for t in tests.values():
        outcomes.setdefault(given(t), set()).add(
            json.dumps([t.output, t.stdout], sort_keys=True, default=str)
        )
    return {key for key, t in tests.items() if len(outcomes[given(t)]) > 1}


def build_tasks(records: list[tuple[str, dict]], sandbox, *, max_failing: int = MAX_FAILING) -> LogTasks:
    """Deduplicated, checked tasks from log records (see the module docstring); of each request's
    distinct failing programs the first `max_failing` are run."""
    entries = collect(records)
    dropped: Counter = Counter()
    candidates: list[tuple[Task, list[str]]] = []
    for e in entries.values():
        if not e.tests:
            dropped["no test derivable (no expected output, input or tests)"] += 1
            continue
        if e.reference is None and (conflicts := _conflicting(e.tests)):
            e.tests = {k: t for k, t in e.tests.items() if k not in conflicts}
            if not e.tests:
                dropped["one input logged with different expected values, and no reference to decide"] += 1
                continue
        if not e.failing:
            dropped["no failing program logged (solved first time)"] += 1
            continue
        tests = [t.model_copy(update={"name": t.name or f"test_{i}"}) for i, t in enumerate(e.tests.values())]
        digest = hashlib.sha1(
            json.dumps(
                [e.prompt, e.entry_point, [t.model_dump() for t in tests]], sort_keys=True, default=str
            ).encode()
        ).hexdigest()[:12]
        failing = list(dict.fromkeys(e.failing))[:max_failing]
        task = Task(
            id=f"logs-{digest}",
            domain=e.domain,
            prompt=e.prompt,
            entry_point=e.entry_point,
            tests=tests,
            examples=e.examples,
            reference_solution=e.reference,
            metadata={
                "source": "logs",
                "failing_programs": failing[:5],
                "errors": list(dict.fromkeys(x for x in e.errors if x))[:5],
            },
        )
        candidates.append((task, failing))
    runs = [
        (task, program)
        for task, failing in candidates
        for program in [task.reference_solution, *failing]
        if program
    ]
    results = iter(sandbox.run_tests_batch(runs))
    kept = []
    for task, failing in candidates:
        reference_ok = next(results).all_passed if task.reference_solution else True
        failing_caught = [not next(results).all_passed for _ in failing]
        if not reference_ok:
            dropped["the reference fails the derived tests"] += 1
        elif not any(failing_caught):
            dropped["the logged failing code passes the derived tests"] += 1
        else:
            kept.append(task)
    return LogTasks(kept, len(records), dropped)
