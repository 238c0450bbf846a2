"""One result record (results/NAME.json) for a headline figure, written by a bench script's `--record PATH`.

A record says what was measured, on which code, machine and day, and by which command, so the docs'
results table (tools/docs_results.py) is generated from records rather than typed by hand. The commit is
this checkout's HEAD; a checkout with uncommitted changes says so in `notes`, since its HEAD is not the
code that ran.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

# The fields every record has; tools/docs_results.py requires the same ones.
FIELDS = ("name", "figure", "unit", "value", "values", "date", "commit", "machine", "command", "notes")
ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def machine() -> str:
    """This machine in a few words: its core count and CPU model, and its GPU ('no GPU' when torch sees none)."""
    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    torch = sys.modules.get("torch")  # only asked when the script has loaded torch anyway
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return f"{os.cpu_count()} cores ({model}), {gpu}"


def write_record(
    path: str | Path,
    *,
    name: str,
    figure: str,
    unit: str,
    value: float,
    values: dict[str, float] | None = None,
    notes: str = "",
) -> dict:
    """Write one record to `path` (JSON) and return it; the command is this process's own command line."""
    commit = _git("rev-parse", "--short", "HEAD")
    if _git("status", "--porcelain", "--untracked-files=no"):
        notes = (notes + " " if notes else "") + f"Measured with uncommitted changes on top of {commit}."
    record = {
        "name": name,
        "figure": figure,
        "unit": unit,
        "value": value,
        "values": values or {},
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": machine(),
        "command": shlex.join([".venv/bin/python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "notes": notes,
    }
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"record: {path}")
    return record
