"""Linter findings of model-written programs, for the code-style reward: one ruff process per batch."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def lint_findings(codes: list[str | None]) -> list[int | None]:
    """Findings of ruff (pyflakes F, pycodestyle E/W, bugbear B) per code string; None for code that does
    not parse or is not Python. One ruff process for the whole batch; the code is only read, never run."""
    out: list[int | None] = [None] * len(codes)
    with tempfile.TemporaryDirectory(prefix="tempering-lint-") as tmp:
        paths = {}
        for i, code in enumerate(codes):
            if code is not None:
                path = Path(tmp) / f"c{i}.py"
                path.write_text(code)
                paths[str(path)] = i
        if not paths:
            return out
        ruff = Path(sys.executable).with_name("ruff")
        proc = subprocess.run(
            [
                str(ruff) if ruff.exists() else "ruff",
                "check",
                "--isolated",
                "--no-cache",
                "--select",
                "E,F,W,B",
                "--ignore",
                "E501,W292",
                "--output-format",
                "json",
                tmp,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        counts = {i: 0 for i in paths.values()}
        syntax = set()
        for item in json.loads(proc.stdout or "[]"):
            i = paths.get(item["filename"])
            if i is None:
                continue
            if item.get("code") in (None, "invalid-syntax") or "SyntaxError" in item.get("message", ""):
                syntax.add(i)
            counts[i] += 1
        for i, n in counts.items():
            out[i] = None if i in syntax else n
    return out
