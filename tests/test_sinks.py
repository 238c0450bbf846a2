"""Weights & Biases (offline) and MLflow (local file store) get the same metrics as metrics.jsonl, and the
sample rows as a table."""

import importlib.util
import json
import struct

import pytest

from tempering.config import build_config, load_config
from tempering.errors import ConfigError
from tempering.pipeline import train


def test_a_sink_whose_package_is_missing_fails_at_load(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"tracking.wandb: the 'wandb' package is not installed \(pip install wandb\)"
    ):
        build_config({}, ["tracking.wandb=true"])


@pytest.mark.slow
def test_wandb_offline_and_mlflow_get_every_step(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    train(
        load_config(
            "configs/smoke.yaml",
            [
                f"run.dir={run_dir}",
                f"model.path={tiny_model_dir}",
                "sft.steps=0",
                "train.steps=3",
                "eval.samples=1",
                "eval.every=0",
                "data.num_heldout=4",
                "rollout.prompts_per_step=2",
                "tracking.tensorboard=false",
                "tracking.wandb=true",
                "tracking.mlflow=true",
            ],
        )
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    client = mlflow.tracking.MlflowClient((run_dir / "mlruns").resolve().as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "tempering"]
    [run] = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [
        (r["step"], pytest.approx(r["reward/mean"])) for r in rows
    ]
    assert run.data.params["algo.estimator"] == "grpo"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert artifacts == [f"samples/step_{s:06d}.json" for s in (1, 2, 3)]
    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    [events] = list(offline.glob("run-*.wandb"))
    history, config = {}, {}
    for record in wandb_records(events):
        if record.HasField("history"):
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        if record.HasField("run"):
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
    assert sorted(history) == [r["step"] for r in rows]
    for row in rows:
        logged = history[row["step"]]
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                assert logged[key] == pytest.approx(value), key
    assert config["algo"]["estimator"] == "grpo" and config["run"]["dir"] == str(run_dir)
    tables = [v for step in history.values() for k, v in step.items() if k == "samples/nrows"]
    assert tables and all(n == 8 for n in tables)  # prompts_per_step x group_size sample rows a step


def wandb_records(path):
    """The protobuf records of an offline .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log blocks of 32 KiB whose chunks (7-byte header: crc, length, type) make up the records."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, part = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or the LAST chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            yield record
            part = b""
