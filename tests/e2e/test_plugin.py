"""The plug-in example (`examples/plugin/`): an environment, a reward function and a policy loss of a package
outside tempering, named by import path - checked when the config loads, trained with, resumed exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tempering.config import load_config
from tempering.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "plugin"
CONFIG = "examples/plugin/plugin.yaml"
ENV = "tempering_plugin_example.env:ReverseEnv"
REWARD = "tempering_plugin_example.rewards:one_line"
# Small enough to train a few times in one test (seconds each).
FAST = [
    "sft.steps=4",
    "eval.every=0",
    "eval.samples=1",
    "tracking.tensorboard=false",
    "checkpoint.every=1",
    "train.steps=6",
]
VOLATILE = ("timing_s/", "perf/")


@pytest.fixture()
def plugin_path(monkeypatch):
    """The plug-in package importable here and in the subprocesses (PYTHONPATH), as `pip install` would."""
    monkeypatch.syspath_prepend(str(PLUGIN))
    paths = [str(PLUGIN), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def train_command(run_dir, *overrides):
    return [sys.executable, "-m", "tempering.cli", "train", CONFIG, f"run.dir={run_dir}", *FAST, *overrides]


def train(run_dir, *overrides, check=True):
    proc = subprocess.run(
        train_command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"tempering train failed:\n{proc.stderr[-3000:]}")
    return proc


def kill_after_a_checkpoint(run_dir):
    """Start the run and SIGKILL it as soon as any checkpoint is LATEST; returns that step."""
    proc = subprocess.Popen(
        train_command(run_dir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    latest = run_dir / "checkpoints" / "LATEST"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not latest.is_file():
        time.sleep(0.002)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return int(latest.read_text().strip().split("_")[1])


def stable_metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.slow
def test_the_plugin_trains_with_its_own_env_reward_and_loss_and_resumes_exactly(plugin_path, tmp_path):
    reference = tmp_path / "reference"
    train(reference)
    rows = stable_metrics(reference)
    assert [r["step"] for r in rows] == list(range(1, 7))
    # Keys only the plug-in writes: its environment's component, its reward function, its loss, its domain.
    only_the_plugin = {
        "reward/letters/mean",
        f"reward/{REWARD}/mean",
        "actor/hard_clipfrac",
        "reward/reverse/mean",
    }
    assert all(only_the_plugin <= set(row) for row in rows)
    lines = (reference / "samples" / "step_000001.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    assert all(
        set(s["turns"][0]["rewards"]) == {"letters"} and set(s["components"]) == {"letters", REWARD}
        for s in samples
    )

    killed = tmp_path / "killed"
    step = kill_after_a_checkpoint(killed)
    assert step < 6 and not (killed / "summary.json").exists()
    train(killed)
    assert stable_metrics(killed) == rows


@pytest.mark.parametrize(
    "override, message",
    [
        (
            f"env.plugins=[{ENV.replace('Reverse', 'Revers')}]",
            "env.plugins: environment 'tempering_plugin_example.env:ReversEnv': module "
            "'tempering_plugin_example.env' has no callable 'ReversEnv'",
        ),
        (
            f"reward.params={{{REWARD}: {{max_charz: 3}}}}",
            f"reward.params.{REWARD}: unknown parameter(s) max_charz; accepted: max_chars",
        ),
        ("env.plugins=[]", f"task 'reverse-0': env '{ENV}' is not listed in env.plugins"),
    ],
)
def test_plugin_mistakes_are_one_line_and_write_nothing(plugin_path, tmp_path, override, message):
    """Exit status 2 and one line naming the problem; the run directory is never created."""
    run_dir = tmp_path / "run"
    # Without the environment listed, its component `letters` is not a reward.weights name either.
    extra = [f"reward.weights={{{REWARD}: 1.0}}"] if override == "env.plugins=[]" else []
    proc = train(run_dir, override, *extra, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "env.plugins=[tempering_plugin_exampel.env:ReverseEnv]",
            "env.plugins: environment 'tempering_plugin_exampel.env:ReverseEnv': cannot import module",
        ),
        (
            f"env.plugins=[{REWARD}]",
            f"env.plugins: environment '{REWARD}' is not a subclass of tempering.envs.Environment",
        ),
        ("env.plugins=[answer]", "env.plugins: 'answer' is not of the form 'package.module:Class'"),
        (
            "algo.policy_loss=tempering_plugin_example.loss:hard_clip",
            "algo.policy_loss: policy loss "
            "'tempering_plugin_example.loss:hard_clip': module 'tempering_plugin_example.loss' has no callable",
        ),
        ("algo.clip_ratoi=0.3", "unknown config key 'algo.clip_ratoi'"),
        ("reward.weights={letter: 1.0}", "reward.weights: unknown name 'letter'"),
    ],
)
def test_plugin_config_mistakes_name_what_is_wrong(plugin_path, override, message):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / CONFIG, ["reward.params={}", override])
    assert message in str(e.value)


def test_the_example_config_loads_with_the_plugin_on_the_path(plugin_path):
    cfg = load_config(ROOT / CONFIG)
    assert cfg.env.plugins == [ENV] and REWARD in cfg.reward.weights
    assert cfg.algo.policy_loss == "tempering_plugin_example.loss:hard_clip_loss"


def test_the_shipped_task_files_are_what_the_package_generates(plugin_path, tmp_path):
    from tempering_plugin_example.tasks import write

    write(tmp_path)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_text() == (PLUGIN / "tasks" / name).read_text()
