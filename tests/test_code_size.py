"""The size contract of the source: no module over 450 lines and no function over 80, as formatted by
`ruff format` (`make lint`). The sandbox's worker (`sandbox/_worker.py`) is the one exception: it runs
inside the container with the standard library only, so it cannot be split across tempering's modules."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tempering"
EXEMPT = {"sandbox/_worker.py"}
MAX_MODULE, MAX_FUNCTION = 450, 80
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix() not in EXEMPT)


def too_long(source: str) -> list[str]:
    """What breaks the contract in one module's source: its length, and each function over the limit."""
    out = []
    if (n := len(source.splitlines())) > MAX_MODULE:
        out.append(f"{n} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION:
                out.append(f"{node.name} is {n} lines")
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_modules_and_functions_stay_within_their_size(path):
    assert not too_long(path.read_text()), (
        f"{path.relative_to(PACKAGE)}: {', '.join(too_long(path.read_text()))}"
    )


def test_the_size_check_sees_a_long_function_and_a_long_module():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    assert too_long(f"def f():\n{body}\n") == [f"f is {MAX_FUNCTION + 1} lines"]
    assert too_long("x = 1\n" * (MAX_MODULE + 1)) == [f"{MAX_MODULE + 1} lines"]
    assert too_long("def f():\n    return 1\n") == []
