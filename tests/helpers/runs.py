"""Running the `tempering` command from tests: the repository root, a run (or one killed after a
checkpoint), its metric rows and the figures that are timing rather than results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

VOLATILE = ("timing_s/", "perf/")


def tempering(*args, check=True, **kw):
    proc = subprocess.run(
        [sys.executable, "-m", "tempering.cli", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"tempering {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return proc


def kill_after_checkpoint(run_dir, step, *overrides):
    """Start `tempering train` on the smoke recipe and SIGKILL it as soon as checkpoint `step` is LATEST."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tempering.cli",
            "train",
            "configs/smoke.yaml",
            f"run.dir={run_dir}",
            *overrides,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = run_dir / "checkpoints" / "LATEST"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == f"step_{step:06d}":
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def versions(run_dir):
    """step -> the policy versions of its sample rows."""
    return {
        int(f.stem.split("_")[1]): {json.loads(line)["policy_version"] for line in f.read_text().splitlines()}
        for f in sorted((run_dir / "samples").glob("step_*.jsonl"))
    }


def closed_port() -> int:
    """A loopback port nothing listens on (one that was just free)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLOSED_URL = "sandbox.url=http://127.0.0.1:{port}"
"""An override naming a sandbox service that is down; the port is chosen when the test runs (test ids must be
the same in every pytest-xdist worker)."""

# A run small enough to be trained several times in one test: ~2 s of work per invocation.
TINY = [
    "sft.steps=4",
    "data.num_train=80",
    "data.num_heldout=8",
    "eval.every=0",
    "eval.samples=1",
    "tracking.tensorboard=false",
    "checkpoint.every=1",
]


def train_tiny(run_dir, *overrides, check=True):
    return tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *TINY, *overrides, check=check)
