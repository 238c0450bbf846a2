"""Optional metric sinks beside metrics.jsonl and TensorBoard: Weights & Biases (offline by default) and
MLflow (a local file store in the run directory). Same metric names; the sample rows go to a table.

Each is used only when configured (`tracking.wandb`, `tracking.mlflow`), and the config check says so at
load time when the package is not installed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

SAMPLE_COLUMNS = ["step", "task_id", "domain", "reward", "completion"]


def sample_table(step: int, rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Sample rows as table rows: the completion is the last turn's action."""
    out = []
    for r in rows:
        turns = r.get("turns") or [{}]
        out.append([step, r.get("task_id"), r.get("domain"), r.get("reward"), turns[-1].get("action", "")])
    return out


class WandbSink:
    """A W&B run in RUN_DIR/wandb, offline unless WANDB_MODE says otherwise (`wandb sync` uploads it); a
    resumed run continues the same W&B run (its id is the run directory's name)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str):
        import wandb

        self.wandb = wandb
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.resolve().name)
        self.run = wandb.init(
            project=project,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            name=run_dir.name,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=SAMPLE_COLUMNS, data=sample_table(step, rows))
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in the file store RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], experiment: str):
        # MLflow 3 asks file-store users to opt in (it prefers a database); a local file store is the point here.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params({k: str(v)[:250] for k, v in _flat(config).items()})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        # The layout of MLflow's own table artifacts (`log_table`, which would need pandas).
        self.mlflow.log_dict(
            {"columns": SAMPLE_COLUMNS, "data": sample_table(step, rows)}, f"samples/step_{step:06d}.json"
        )

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
