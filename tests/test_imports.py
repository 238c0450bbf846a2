"""The import contract (imports only go downward), read from the source with `ast`.

Every `import` counts, at module level, inside a function (a deferred import still ties the two files
together) or under `if TYPE_CHECKING:` (a type-only import is a dependency all the same: the records two
files share live in a lower module, `types.py`, instead). `from pkg import name` is an edge to `pkg/name.py` when that
is a module, else to `pkg/__init__.py`; importing `pkg.mod` is not counted as an edge to `pkg/__init__.py`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tempering"

ACYCLIC = None
"""Packages whose files may lie on no import cycle (None: every file of tempering)."""
"""Sub-packages none of whose files may lie on an import cycle (to become every file of tempering)."""
LEAVES = {
    "errors.py": {"errors.py"},
    "types.py": {"errors.py"},
    "registry.py": {"errors.py", "types.py"},
    "config.py": {"errors.py", "config_sections.py", "config_algo.py"},
    "config_sections.py": set(),
    "config_algo.py": {"config_sections.py"},
}
"""Leaf module -> the only tempering files it may import."""
PURE = "algos"
PURE_EXTERNAL = {"torch", "__future__", *sys.stdlib_module_names}
PURE_INTERNAL = {"errors.py", "registry.py"}
"""`algos/` is the pure math layer: torch and the standard library, tempering's errors and registry only."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing file, relative to src/tempering (`sandbox/pool.py`)."""
    line: int
    module: str
    """The module named, absolute (`tempering.sandbox.isolation`, `torch.nn`)."""
    target: str | None
    """The tempering file it loads (`sandbox/isolation.py`); None for anything outside tempering."""


def module_file(module: str) -> str | None:
    """`tempering.a.b` -> `a/b.py` or `a/b/__init__.py`; None when no such file (or not tempering)."""
    parts = module.split(".")
    if parts[0] != "tempering":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    candidates = (
        [base / "__init__.py"] if len(parts) == 1 else [base.with_suffix(".py"), base / "__init__.py"]
    )
    return next((p.relative_to(PACKAGE).as_posix() for p in candidates if p.is_file()), None)


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, `if TYPE_CHECKING:` bodies included."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def imports_of(path: Path) -> list[Import]:
    rel = path.relative_to(PACKAGE).as_posix()
    package = [
        "tempering",
        *path.relative_to(PACKAGE).parent.parts,
    ]  # the package `from . import` is relative to
    found: list[Import] = []
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, a.name, module_file(a.name)) for a in node.names]
            continue
        base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
        module = ".".join(filter(None, [base, node.module or ""]))
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            target = module_file(sub) if alias.name != "*" else None
            found.append(Import(rel, node.lineno, sub if target else module, target or module_file(module)))
    return found


def all_imports() -> list[Import]:
    return [i for path in sorted(PACKAGE.rglob("*.py")) for i in imports_of(path)]


def cycles(
    edges: dict[str, dict[str, int]], through: Callable[[str], bool] = lambda f: True
) -> list[list[str]]:
    """One cycle (first file repeated at the end) per strongly connected component that has one and has a
    file for which `through` is true; the cycle passes through that file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graphs here are a few hundred files, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        members, starts = set(component), sorted(filter(through, component))
        if not starts or (len(component) == 1 and starts[0] not in edges.get(starts[0], {})):
            continue
        start = starts[0]
        # Shortest way back to `start` inside the component (breadth-first), so the message names a real loop.
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            reached = []
            for v in frontier:
                for w in sorted(edges.get(v, {})):
                    if w in members and w not in came_from:
                        came_from[w] = v
                        reached.append(w)
            frontier = reached
        path, node = [start], came_from[start]
        while node != start:
            path.append(node)
            node = came_from[node]
        found.append([start, *reversed(path[1:]), start])
    return found


def describe(cycle: list[str], edges: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def graph(imports: list[Import]) -> dict[str, dict[str, int]]:
    """File -> {imported file: line of its first import there}, over every file of tempering."""
    edges: dict[str, dict[str, int]] = {}
    for i in imports:
        if i.target and i.target != i.source:
            edges.setdefault(i.source, {}).setdefault(i.target, i.line)
    return edges


def in_acyclic(file: str) -> bool:
    return ACYCLIC is None or ("/" in file and file.split("/")[0] in ACYCLIC)


def package_of(file: str) -> str:
    """`sandbox/pool.py` -> `sandbox`, `loop.py` -> `loop`: the unit of the layering."""
    return file.split("/")[0].removesuffix(".py")


# ------------------------------------------------------------------------------------------------ tests


def test_no_import_cycle_between_files():
    edges = graph(all_imports())
    found = [describe(c, edges) for c in cycles(edges, through=in_acyclic)]
    assert not found, (
        "import cycles between files (move the shared piece into a lower module):\n" + "\n".join(found)
    )


def test_no_import_cycle_between_packages():
    """Imports between packages go one way (orchestration -> components -> pure math -> leaves);
    the package root `__init__.py` (which only registers the config checks) is left out."""
    edges: dict[str, dict[str, int]] = {}
    for i in all_imports():
        if i.target and i.source != "__init__.py" and i.target != "__init__.py":
            a, b = package_of(i.source), package_of(i.target)
            if a != b:
                edges.setdefault(a, {}).setdefault(b, i.line)
    found = [describe(c, edges) for c in cycles(edges)]
    assert not found, "packages that import each other (one of them should move down):\n" + "\n".join(found)


def test_leaf_modules_import_only_leaves():
    bad = [
        f"{i.source}:{i.line} imports {i.module}"
        for i in all_imports()
        if i.source in LEAVES and i.module.split(".")[0] == "tempering" and i.target not in LEAVES[i.source]
    ]
    assert not bad, "leaf modules must not import the rest of tempering:\n" + "\n".join(bad)


def test_pure_math_imports_only_torch_and_stdlib():
    bad = []
    for i in all_imports():
        if not i.source.startswith(f"{PURE}/"):
            continue
        top = i.module.split(".")[0]
        if top == "tempering":
            ok = i.target is not None and (i.target.startswith(f"{PURE}/") or i.target in PURE_INTERNAL)
        else:
            ok = top in PURE_EXTERNAL
        if not ok:
            bad.append(f"{i.source}:{i.line} imports {i.module}")
    assert not bad, (
        f"{PURE}/ may import only torch, the standard library and tempering.errors/registry:\n"
        + "\n".join(bad)
    )


# ------------------------------------------------------------------------------------- the checker itself


def test_checker_finds_a_cycle_and_names_it():
    edges = {
        "a/x.py": {"a/y.py": 3},
        "a/y.py": {"a/z.py": 5},
        "a/z.py": {"a/x.py": 7},
        "a/w.py": {"a/x.py": 1},
    }
    (cycle,) = cycles(edges)
    assert cycle == ["a/x.py", "a/y.py", "a/z.py", "a/x.py"]
    assert describe(cycle, edges) == "a/x.py (line 3) -> a/y.py (line 5) -> a/z.py (line 7) -> a/x.py"
    assert cycles(edges, through=lambda f: f == "a/y.py") == [["a/y.py", "a/z.py", "a/x.py", "a/y.py"]]
    assert cycles(edges, through=lambda f: f == "a/w.py") == []
    assert cycles({"a/x.py": {"a/y.py": 1}, "a/y.py": {}}) == []


def test_checker_reads_deferred_relative_and_type_checking_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "tempering"
    (pkg / "p").mkdir(parents=True)
    for name in ("__init__.py", "p/__init__.py", "p/a.py", "p/b.py", "p/c.py"):
        (pkg / name).touch()
    (pkg / "p/a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tempering.p import c\n"
        "def f():\n    from . import b\n    from .c import thing\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    found = {(i.line, i.target) for i in imports_of(pkg / "p/a.py") if i.target}
    assert found == {(3, "p/c.py"), (5, "p/b.py"), (6, "p/c.py")}
