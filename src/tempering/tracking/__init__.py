"""Run tracking: metrics.jsonl, TensorBoard events, per-step sample files and a progress display.

On resume from checkpoint k, rows of steps after k (written by the interrupted run, and about to be
recomputed) are dropped from metrics.jsonl and TensorBoard is told to purge them, so every file holds
exactly one row per step.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tempering.errors import DiskFullError, disk_full


@dataclass
class Timer:
    """Seconds per named phase of a step (`timing_s/<name>`), summed when a phase runs more than once."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{name}"] = (
            self.seconds.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
        )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a line cut short by a crash: it and anything after it are discarded
    return rows


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Tracker:
    """Writes one metrics row per step to every sink."""

    def __init__(
        self,
        run_dir: Path,
        *,
        start_step: int,
        total_steps: int,
        tensorboard: bool = True,
        progress: bool = True,
        console: Console | None = None,
        wandb: bool = False,
        mlflow: bool = False,
        project: str = "tempering",
        config: dict[str, Any] | None = None,
    ):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.failed = False  # a write failed on a full disk: closing does not raise again
        kept = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= start_step]
        tmp = self.metrics_path.with_name("metrics.jsonl.tmp")
        with self._writing(tmp):
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.metrics_path)
        self._file = self.metrics_path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            with self._writing(run_dir / "tb"):
                self.tb = SummaryWriter(
                    str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None
                )
        from tempering.tracking.sinks import MlflowSink, WandbSink

        self.sinks = ([WandbSink(run_dir, config or {}, project)] if wandb else []) + (
            [MlflowSink(run_dir, config or {}, project)] if mlflow else []
        )
        self.console = console or Console(stderr=True)
        self.total = total_steps
        self._progress = None
        self._last_line = 0.0
        if progress and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]RL"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("rl", total=total_steps, completed=start_step, stats="")
            self._progress.start()
        self._show = progress

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _json_float(float(v)) for k, v in metrics.items()}}
        with self._writing(self.metrics_path):
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self.tb is not None:
            with self._writing(self.run_dir / "tb"):
                for key, value in metrics.items():
                    if math.isfinite(value):
                        self.tb.add_scalar(key, value, step)
        for sink in self.sinks:
            sink.log(step, {k: v for k, v in metrics.items() if math.isfinite(v)})
        self._display(step, metrics)

    def _display(self, step: int, m: dict[str, float]) -> None:
        if not self._show:
            return
        stats = f"reward {m.get('reward/mean', 0):.3f}  pass {m.get('train/pass_rate', 0):.1%}"
        if "val/pass@1" in m:
            stats += f"  val {m['val/pass@1']:.1%}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
        elif time.monotonic() - self._last_line > 10 or step == self.total:
            # Not a terminal (CI, nohup): a plain line now and then instead of a redrawn bar.
            self._last_line = time.monotonic()
            print(f"step {step}/{self.total}  {stats}", file=sys.stderr, flush=True)

    def write_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        directory = self.run_dir / "samples"
        directory.mkdir(exist_ok=True)
        path = directory / f"step_{step:06d}.jsonl"
        with self._writing(path):
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for sink in self.sinks:
            sink.samples(step, rows)

    @contextmanager
    def _writing(self, path: Path):
        """A write the run cannot go on without: on a full disk the run ends with one line naming the file
        (the newest checkpoint stays valid; rows after it are recomputed on resume)."""
        try:
            yield
        except Exception as e:
            if not disk_full(e, path):
                raise
            self.failed = True
            raise DiskFullError(
                f"disk full writing {path}: make room and run the same command again "
                "(it resumes from the newest checkpoint)"
            ) from None

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        closers = (
            ([self.tb.close] if self.tb is not None else [])
            + [s.close for s in self.sinks]
            + [self._file.close]
        )
        self.tb, self.sinks = None, []
        for close in closers:
            try:
                close()
            except Exception:
                if not self.failed:  # after a full disk, what is left to flush fails again: said once already
                    raise
