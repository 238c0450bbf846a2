"""A resumed run's config against the one its run directory (or checkpoint) recorded."""

import json

import pytest
import yaml

from tempering import config_history as ch
from tempering.config import build_config
from tempering.errors import ConfigError


def _run_dir(tmp_path, overrides=()):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = build_config({}, [f"run.dir={run_dir}", *overrides])
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return run_dir, cfg


def test_no_record_or_same_config_is_no_change(tmp_path):
    cfg = build_config({}, [f"run.dir={tmp_path / 'fresh'}"])
    assert ch.check_resume(tmp_path / "fresh", cfg, allow=False) is None
    run_dir, cfg = _run_dir(tmp_path)
    assert ch.check_resume(run_dir, cfg, allow=False) is None


def test_mutable_keys_change_freely_and_are_listed():
    for key in (
        "train.steps",
        "train.max_time_s",
        "run.threads",
        "run.dir",
        "checkpoint.every",
        "tracking.progress",
        "checkpoint.storage.key",
        "sandbox.workers",
    ):
        assert ch.is_mutable(key), key
    for key in (
        "algo.lr",
        "trainer.steps",
        "run.seed",
        "rollout.group_size",
        "reward.weights.tests",
        "sandbox.memory_mb",
    ):
        assert not ch.is_mutable(key), key


def test_more_steps_is_allowed_and_recorded(tmp_path):
    run_dir, _ = _run_dir(tmp_path, ["train.steps=6"])
    cfg = build_config({}, [f"run.dir={run_dir}", "train.steps=8", "train.max_time_s=60"])
    change = ch.check_resume(run_dir, cfg, allow=False)
    assert change.forced == [] and change.changed == {"train.max_time_s": (None, 60.0), "train.steps": (6, 8)}
    entry = ch.record(run_dir, change, allowed_by_flag=False)
    assert entry["allowed_by_flag"] is False and entry["changed"]["train.steps"] == {"old": 6, "new": 8}


def test_other_change_is_refused_on_one_line_naming_the_keys(tmp_path):
    run_dir, _ = _run_dir(tmp_path)
    before = sorted(p.name for p in run_dir.iterdir())
    cfg = build_config(
        {}, [f"run.dir={run_dir}", "algo.lr=5e-4", "reward.weights={tests: 1.0}", "train.steps=9"]
    )
    with pytest.raises(ConfigError) as e:
        ch.check_resume(run_dir, cfg, allow=False)
    msg = str(e.value)
    assert "\n" not in msg and "--allow-config-change" in msg
    assert "algo.lr 0.0001 -> 0.0005" in msg and "reward.weights.tests <unset> -> 1.0" in msg
    assert "train.steps 150" not in msg  # a key that may change is not what the refusal is about
    assert sorted(p.name for p in run_dir.iterdir()) == before  # checking writes nothing


def test_flag_accepts_and_keeps_the_old_config(tmp_path):
    run_dir, _ = _run_dir(tmp_path)
    old_text = (run_dir / "config.yaml").read_text()
    cfg = build_config({}, [f"run.dir={run_dir}", "algo.lr=5e-4"])
    change = ch.check_resume(run_dir, cfg, allow=True)
    assert change.forced == ["algo.lr"]
    ch.record(run_dir, change, allowed_by_flag=True)
    assert (run_dir / "config_history" / "0001.yaml").read_text() == old_text
    [entry] = ch.read_history(run_dir)
    assert entry["forced"] == ["algo.lr"] and entry["allowed_by_flag"] is True
    assert entry["previous_config"] == "config_history/0001.yaml"
    assert entry["changed"]["algo.lr"] == {"old": 0.0001, "new": 0.0005}


def test_a_key_added_to_the_code_later_is_not_a_change(tmp_path):
    """A run made before a field existed: its config.yaml lacks the key, which reads as today's default."""
    run_dir, cfg = _run_dir(tmp_path)
    tree = yaml.safe_load((run_dir / "config.yaml").read_text())
    del tree["algo"]["skip_zero_advantage"], tree["env"]["options"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(tree))
    assert ch.check_resume(run_dir, cfg, allow=False) is None


def test_without_config_yaml_the_newest_checkpoint_is_compared(tmp_path):
    from tempering.checkpoint import write_manifest

    run_dir, _ = _run_dir(tmp_path)
    step = run_dir / "checkpoints" / "step_000002"
    (step / "model").mkdir(parents=True)
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt", "model/config.json"):  # (what a checkpoint lists)
        (step / name).write_text("")
    (step / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    (step / "trainer_state.json").write_text(json.dumps({"step": 2}))
    write_manifest(step)
    (run_dir / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="algo.lr"):
        ch.check_resume(run_dir, build_config({}, [f"run.dir={run_dir}", "algo.lr=5e-4"]), allow=False)


def test_checkpoint_from_another_config_is_refused_unless_vetted(tmp_path):
    """A checkpoint (e.g. downloaded from checkpoint.uri into a fresh run directory) saved under another
    config is refused; one saved under a config the run recorded in its history passes."""
    run_dir, old_cfg = _run_dir(tmp_path)
    ckpt_dir = run_dir / "checkpoints" / "step_000004"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "config.yaml").write_text(old_cfg.to_yaml())
    new = build_config({}, [f"run.dir={run_dir}", "algo.lr=5e-4", "train.steps=300"])
    with pytest.raises(ConfigError, match="checkpoint step_000004.*algo.lr"):
        ch.check_checkpoint(run_dir, ckpt_dir, new, allow=False)
    assert ch.check_checkpoint(run_dir, ckpt_dir, new, allow=True).forced == ["algo.lr"]
    # The change was accepted and recorded (prepare), the checkpoint predates it: it passes without the flag.
    ch.record(run_dir, ch.check_resume(run_dir, new, allow=True), allowed_by_flag=True)
    assert ch.check_checkpoint(run_dir, ckpt_dir, new, allow=False) is None
    # Only a checkpoint saved under the same config passes (train.steps may differ).
    same = build_config({}, [f"run.dir={run_dir}", "train.steps=300"])
    assert ch.check_checkpoint(run_dir, ckpt_dir, same, allow=False) is None
