"""Production error logs -> sandbox tasks (`tempering data from-logs LOGS... --out tasks.jsonl`).

Two kinds of JSONL records are read (a file may mix them):

* the repair agent's attempt log (`tempering repair --log`, `agent.repair.ATTEMPT_FIELDS`): each record
  carries its task, tests included; the failing attempts become the logged failures, and an attempt that
  passed serves as the reference when the task has none;
* a user's own error records, one per failure:

      {"prompt": "...",          the request the model answered (the task text)       required
       "code": "...",            the program that failed                               required
       "entry_point": "f",       the function the test calls (omit for a stdin/stdout program)
       "input": [1, 2],          the failing call's arguments   } or "stdin": "...", or "tests": [...]
       "expected": 3,            its expected result / stdout  }  (TestCase objects, tempering's schema)
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
the reason counted. The result is an evaluation set for `tempering eval` and an RL task file for
`tempering train` (`data.train_file`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tempering.errors import TaskFileError
from tempering.types import Task, TestCase


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
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise TaskFileError(f"{path}:{n}: a log record is a JSON object")
            out.append((f"{path}:{n}", record))
    return out


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
                if r.get("class") == "passed":
                    e.reference = e.reference or r["program"]
                else:
                    e.failing.append(r["program"])
                    e.errors.append(r.get("message") or r.get("class") or "")
            elif r.get("event") is None:  # (the server's request log and other events carry no task)
                _user_record(r, entry)
        except (KeyError, TypeError, ValueError, ValidationError) as ex:
            why = f"missing field {ex}" if isinstance(ex, KeyError) else str(ex).splitlines()[0]
            raise TaskFileError(f"{where}: not an agent attempt or an error record ({why})") from None
    return entries


def _user_record(r: dict[str, Any], entry) -> None:
    prompt, code = r["prompt"], r["code"]
    if not isinstance(prompt, str) or not isinstance(code, str):
        raise ValueError("'prompt' and 'code' must be strings")
    e = entry(prompt, r.get("entry_point"), r.get("domain", "logs"))
    for t in r.get("tests") or []:
        e.add_test(TestCase.model_validate(t))
    if "expected" in r:
        if "input" in r:
            e.add_test(TestCase(input=list(r["input"]), output=r["expected"]))
        elif "stdin" in r:
            e.add_test(TestCase(stdin=r["stdin"], stdout=str(r["expected"])))
        else:
            raise ValueError("'expected' needs the failing 'input' (a call's arguments) or 'stdin'")
    e.failing.append(code)
    e.errors.append(str(r.get("error", "")))
    if r.get("reference"):
        e.reference = e.reference or r["reference"]


def _conflicting(tests: dict[str, TestCase]) -> set[str]:
    """Keys of the test cases whose input (call arguments or stdin) another case expects something else of."""
    def given(t: TestCase) -> str:
        return json.dumps([t.input, t.stdin], sort_keys=True, default=str)

    outcomes: dict[str, set[str]] = {}
    for t in tests.values():
        outcomes.setdefault(given(t), set()).add(json.dumps([t.output, t.stdout], sort_keys=True, default=str))
    return {key for key, t in tests.items() if len(outcomes[given(t)]) > 1}


def build_tasks(records: list[tuple[str, dict]], sandbox) -> LogTasks:
    """Deduplicated, checked tasks from log records (see the module docstring)."""
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
        digest = hashlib.sha1(json.dumps([e.prompt, e.entry_point, [t.model_dump() for t in tests]],
                                         sort_keys=True, default=str).encode()).hexdigest()[:12]
        failing = list(dict.fromkeys(e.failing))
        task = Task(id=f"logs-{digest}", domain=e.domain, prompt=e.prompt, entry_point=e.entry_point, tests=tests,
                    examples=e.examples, reference_solution=e.reference,
                    metadata={"source": "logs", "failing_programs": failing[:5],
                              "errors": list(dict.fromkeys(x for x in e.errors if x))[:5]})
        candidates.append((task, failing))
    runs = [(task, program) for task, failing in candidates for program in [task.reference_solution, *failing]
            if program]
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
