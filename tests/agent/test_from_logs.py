"""Error logs -> sandbox tasks: tests derived from the records, checked on creation, deduplicated."""

import json
import subprocess
import sys
from collections import Counter

import pytest

from tempering.agent.monitor import JsonLog
from tempering.agent.repair import repair
from tempering.data import load_tasks
from tempering.data.from_logs import MAX_FAILING, build_tasks, read_records
from tempering.envs import EnvContext
from tempering.errors import TaskFileError
from tempering.types import Task, TestCase

PROMPT = 'def median3(a, b, c):\n    """The middle one of three numbers."""\n'
WRONG = "def median3(a, b, c):\n    return sorted([a, b, c])[0]\n"
RIGHT = "def median3(a, b, c):\n    return sorted([a, b, c])[1]\n"


def user_record(**kw):
    return {"prompt": PROMPT, "entry_point": "median3", "code": WRONG, "error": "wrong result", **kw}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_user_records_become_one_checked_task(sandbox, tmp_path):
    log = write(
        tmp_path / "errors.jsonl",
        [
            user_record(input=[3, 1, 2], expected=2),
            user_record(input=[9, 7, 8], expected=8, reference=RIGHT),
            user_record(input=[3, 1, 2], expected=2),  # the same failure again
            {
                "prompt": "def neg(x):\n",
                "entry_point": "neg",
                "code": "def neg(x):\n    return -x\n",
                "input": [2],
                "expected": -2,
            },  # logged, but the code is right
            {
                "prompt": "def sq(x):\n",
                "entry_point": "sq",
                "code": "def sq(x):\n    return x * 2\n",
                "input": [3],
                "expected": 9,
                "reference": "def sq(x):\n    return x + x\n",
            },  # a wrong reference
        ],
    )
    built = build_tasks(read_records([log]), sandbox)
    [task] = built.tasks
    assert task.prompt == PROMPT and task.entry_point == "median3"
    assert [(t.input, t.output) for t in task.tests] == [([3, 1, 2], 2), ([9, 7, 8], 8)]  # pooled, each once
    assert task.reference_solution == RIGHT and task.metadata["failing_programs"] == [WRONG]
    assert sandbox.run_tests_batch([(task, RIGHT)])[0].all_passed  # the reference passes
    assert not sandbox.run_tests_batch([(task, WRONG)])[0].all_passed  # the logged failure fails
    assert built.dropped == {
        "the logged failing code passes the derived tests": 1,
        "the reference fails the derived tests": 1,
    }


def test_agent_logs_become_tasks_with_their_repair_as_reference(sandbox, tmp_path, tiny):
    from tests.helpers.repair import Scripted

    task = Task(
        id="m",
        domain="d",
        prompt=PROMPT,
        entry_point="median3",
        tests=[TestCase(input=[1, 2, 3], output=2), TestCase(input=[5, 4, 6], output=5)],
    )
    log = tmp_path / "agent.jsonl"
    for _ in range(2):  # the same task failed twice in production: one task comes out
        repair(Scripted(tiny[1], {"median3": [WRONG, RIGHT]}), [task], EnvContext(sandbox), log=JsonLog(log))
    built = build_tasks(read_records([log]), sandbox)
    [made] = built.tasks
    assert [(t.input, t.output) for t in made.tests] == [(t.input, t.output) for t in task.tests]
    assert made.reference_solution == RIGHT and made.metadata["failing_programs"] == [WRONG]
    assert made.metadata["errors"] == ["2 of 2 hidden tests fail"]


def test_cli_writes_eval_and_train_files_and_never_overwrites(sandbox, tmp_path):
    records = [
        user_record(
            prompt=f"def f{i}(a, b, c):\n",
            entry_point=f"f{i}",
            code=WRONG.replace("median3", f"f{i}"),
            input=[3, 1, 2],
            expected=2,
        )
        for i in range(12)
    ]
    log = write(tmp_path / "errors.jsonl", records)
    out = tmp_path / "tasks.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "tempering.cli",
        "data",
        "from-logs",
        str(log),
        "--out",
        str(out),
        "--heldout-fraction",
        "0.25",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    train, heldout = load_tasks(out), load_tasks(tmp_path / "tasks.heldout.jsonl")
    assert len(train) + len(heldout) == 12 and heldout and not {t.id for t in train} & {t.id for t in heldout}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "exists" in again.stderr
    assert len(load_tasks(out)) == len(train)  # nothing written is lost


def test_a_malformed_log_names_the_file_and_line(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps(user_record(input=[1, 2, 3], expected=2)) + "\n{not json\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: not JSON"):
        read_records([log])
    write(log, [{"prompt": PROMPT, "input": [1, 2, 3]}])
    with pytest.raises(TaskFileError, match=r"bad.jsonl:1: .*missing field 'code'"):
        build_tasks(read_records([log]), sandbox=None)


def test_one_input_with_two_expected_values_is_never_written_as_a_test(sandbox, tmp_path):
    """Without a reference no program can pass a task that expects 2 and 3 of the same call: the two
    conflicting cases are left out (the task keeps its other tests), and a task left with none is dropped."""
    records = [
        user_record(input=[3, 1, 2], expected=2),
        user_record(input=[3, 1, 2], expected=3),
        user_record(input=[9, 7, 8], expected=8),
        {
            "prompt": "def one(x):\n",
            "entry_point": "one",
            "code": "def one(x):\n    return 0\n",
            "input": [1],
            "expected": 1,
        },
        {
            "prompt": "def one(x):\n",
            "entry_point": "one",
            "code": "def one(x):\n    return 0\n",
            "input": [1],
            "expected": 2,
        },
    ]
    built = build_tasks(read_records([write(tmp_path / "errors.jsonl", records)]), sandbox)
    [task] = built.tasks
    assert [(t.input, t.output) for t in task.tests] == [([9, 7, 8], 8)]
    assert sandbox.run_tests_batch([(task, RIGHT)])[0].all_passed  # a right program can pass what is written
    assert built.dropped == {"one input logged with different expected values, and no reference to decide": 1}


GOOD_LINE = json.dumps(user_record(input=[1, 2, 3], expected=2)).encode()


@pytest.mark.parametrize(
    "line, message",
    [
        (b'{"prompt": "\xff\xfe", "code": "x"}', r"not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, r"nested deeper than 100 levels"),  # JSON's own recursion
        (GOOD_LINE[:-1] + b', "x": ' + b"[" * 900 + b"]" * 900 + b"}", r"nested deeper"),  # validation's
        (GOOD_LINE.replace(b'"expected": 2', b'"expected": NaN'), r"NaN is not a JSON value"),
        (GOOD_LINE.replace(b'"expected": 2', b'"expected": -Infinity'), r"-Infinity is not a JSON value"),
        (GOOD_LINE.replace(b'"expected": 2', b'"expected": 1e400'), r"1e400 is too large"),
    ],
)
def test_an_unreadable_line_is_one_error_naming_it(tmp_path, line, message):
    log = tmp_path / "bad.jsonl"
    log.write_bytes(GOOD_LINE + b"\n" + line + b"\n")
    with pytest.raises(TaskFileError, match=rf"bad.jsonl:2: {message}"):
        read_records([log])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"entry_point": 5}, "'entry_point' must be a string, not int"),
        ({"domain": ["d"]}, "'domain' must be a string, not list"),
        ({"reference": 7}, "'reference' must be a string, not int"),
        ({"tests": {"a": 1}}, "'tests' must be a list, not dict"),
        ({"stdin": 3}, "'stdin' must be a string, not int"),
        ({"code": None}, "'code' must be a string, not NoneType"),
        (
            {"input": "abc"},
            r"'input' is the call's arguments, a list \(\[\"abc\"\] for one argument\), not str",
        ),
        ({"input": 5}, r"'input' is the call's arguments, a list \(\[5\] for one argument\), not int"),
    ],
)
def test_a_field_of_the_wrong_type_is_one_error_naming_the_line(tmp_path, fields, message):
    """Never a traceback, and never a guess: "input": "abc" is not three arguments 'a', 'b', 'c'."""
    record = {**user_record(expected=2), **({"input": [3, 1, 2]} if "stdin" not in fields else {}), **fields}
    log = write(tmp_path / "bad.jsonl", [record])
    with pytest.raises(TaskFileError, match=rf"bad.jsonl:1: .*{message}"):
        build_tasks(read_records([log]), sandbox=None)


def test_a_wrong_type_in_an_agent_attempt_names_the_field(tmp_path):
    task = {
        "id": "m",
        "domain": "d",
        "prompt": PROMPT,
        "entry_point": "median3",
        "tests": [{"input": [1, 2, 3], "output": 2}],
    }
    log = write(
        tmp_path / "agent.jsonl", [{"event": "attempt", "task": task, "program": 5, "class": "wrong"}]
    )
    with pytest.raises(TaskFileError, match=r"agent.jsonl:1: .*'program' must be a string, not int"):
        build_tasks(read_records([log]), sandbox=None)
    write(log, [{"event": "attempt", "task": {**task, "entry_point": 3}, "program": WRONG}])
    with pytest.raises(
        TaskFileError, match=r"agent.jsonl:1: .*Task field entry_point: Input should be a valid string"
    ):
        build_tasks(read_records([log]), sandbox=None)


class Counting:
    """The sandbox, counting the programs run per task."""

    def __init__(self, sandbox):
        self.sandbox, self.runs = sandbox, Counter()

    def run_tests_batch(self, items):
        self.runs.update(task.prompt for task, _ in items)
        return self.sandbox.run_tests_batch(items)


def test_a_requests_failing_programs_are_run_once_each_and_at_most_max_failing(sandbox, tmp_path):
    """30 distinct failing programs of one request (each logged twice) run 5 at most, plus the reference."""
    wrong = [f"def median3(a, b, c):\n    return {i} + a - a\n" for i in range(30)]
    records = [user_record(code=code, input=[30, 31, 32], expected=31, reference=RIGHT) for code in wrong * 2]
    log = write(tmp_path / "errors.jsonl", records)
    counted = Counting(sandbox)
    built = build_tasks(read_records([log]), counted)
    [task] = built.tasks
    assert counted.runs == {PROMPT: 1 + MAX_FAILING} and task.metadata["failing_programs"] == wrong[:5]
    counted = Counting(sandbox)
    assert len(build_tasks(read_records([log]), counted, max_failing=2).tasks) == 1
    assert counted.runs == {PROMPT: 3}
