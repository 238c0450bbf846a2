"""Weights & Biases (offline) and MLflow (local file store) get the same metrics as metrics.jsonl, and the
sample rows as a table."""

import importlib.util
import json

import pytest

from tempering.config import build_config, load_config
from tempering.errors import ConfigError
from tempering.pipeline import train


def test_a_sink_whose_package_is_missing_fails_at_load(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking.wandb: the 'wandb' package is not installed \(pip install wandb\)"):
        build_config({}, ["tracking.wandb=true"])


@pytest.mark.slow
def test_wandb_offline_and_mlflow_get_every_step(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    train(load_config("configs/smoke.yaml", [
        f"run.dir={run_dir}", f"model.path={tiny_model_dir}", "sft.steps=0", "train.steps=3", "eval.samples=1",
        "eval.every=0", "data.num_heldout=4", "rollout.prompts_per_step=2", "tracking.tensorboard=false",
        "tracking.wandb=true", "tracking.mlflow=true"]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    client = mlflow.tracking.MlflowClient((run_dir / "mlruns").resolve().as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "tempering"]
    [run] = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward/mean"])) for r in rows]
    assert run.data.params["algo.estimator"] == "grpo"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert artifacts == [f"samples/step_{s:06d}.json" for s in (1, 2, 3)]
    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    [events] = list(offline.glob("run-*.wandb"))
    assert events.stat().st_size > 0
