"""Checkpoints beyond the local disk: retention, the asynchronous saver, the fsspec mirror (memory:// and a
real S3-compatible server on loopback), resume from the newest valid copy, SIGTERM, export."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tempering import checkpoint as ckpt
from tempering.errors import CheckpointError
from tests.helpers.runs import ROOT, kill_after_checkpoint, metrics, stable, tempering, train_tiny


def snap(step, parts):  # noqa: F811
    model, tokenizer, opt, sched = parts
    return ckpt.snapshot(
        step,
        model=model,
        tokenizer=tokenizer,
        optimizer=opt,
        scheduler=sched,
        trainer_state={"sampler": {"epoch": 0, "position": step}},
        config_yaml="a: 1\n",
    )


def test_retention_keeps_the_last_k_plus_every_mth(tmp_path, parts):  # noqa: F811
    saver = ckpt.Saver(tmp_path, keep=2, keep_every=4, asynchronous=False)
    for step in range(1, 11):
        saver.save(snap(step, parts))
    saver.close()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000004",
        "step_000008",
        "step_000009",
        "step_000010",
    ]
    assert ckpt.retained(10, [10, 9, 8], keep=1, keep_every=None) and not ckpt.retained(9, [10, 9], 1, None)


def test_async_saver_writes_a_snapshot_of_the_moment_it_was_taken(tmp_path, parts):  # noqa: F811
    model = parts[0]
    saver = ckpt.Saver(tmp_path, keep=3)
    saver.save(snap(1, parts))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():  # training goes on while the save is written
            p.add_(1.0)
    saver.close()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "step_000001" / "model")
    for k, v in saved.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert json.loads((tmp_path / "step_000001" / "trainer_state.json").read_text())["tempering_version"]


def test_memory_mirror_resumes_when_the_local_copy_is_gone(tmp_path, parts):  # noqa: F811
    remote = ckpt.RemoteStore("memory://runs/a", retries=1, backoff_s=0.01)
    saver = ckpt.Saver(tmp_path / "local", keep=2, remote=remote)
    for step in (1, 2, 3):
        saver.save(snap(step, parts))
    saver.close()
    assert remote.steps() == [3, 2]
    for p in (tmp_path / "local").glob("step_*"):
        import shutil

        shutil.rmtree(p)
    got = ckpt.resume_point(tmp_path / "local", remote, log=lambda m: None)
    assert got.step == 3 and ckpt.verify(got.path) is None


def test_a_partial_or_corrupt_remote_checkpoint_is_named_and_skipped(tmp_path, parts):  # noqa: F811
    remote = ckpt.RemoteStore("memory://runs/b", retries=0, backoff_s=0.01)
    saver = ckpt.Saver(tmp_path / "local", keep=5, remote=remote, asynchronous=False)
    for step in (1, 2):
        saver.save(snap(step, parts))
    saver.close()
    remote.fs.pipe_file(remote._path("step_000002", "optimizer.pt"), b"garbage")  # corrupt
    remote.fs.pipe_file(remote._path("step_000003", "rng.pt"), b"half an upload")  # partial: no manifest
    notes = []
    got = ckpt.resume_point(tmp_path / "empty", remote, log=notes.append)
    assert got.step == 1
    assert any("step_000003" in n and "MANIFEST" in n for n in notes)
    assert any("step_000002" in n and "optimizer.pt" in n for n in notes)


def test_a_remote_manifest_naming_a_path_outside_the_checkpoint_is_refused(tmp_path, parts):  # noqa: F811
    """A manifest is input from object storage: `../x` must not make the download write outside its directory."""
    remote = ckpt.RemoteStore("memory://runs/escape", retries=0, backoff_s=0.01)
    saver = ckpt.Saver(tmp_path / "local", keep=5, remote=remote, asynchronous=False)
    saver.save(snap(1, parts))
    saver.close()
    name = "step_000002"
    remote.fs.pipe_file(remote._path(name, "../../../escaped.txt"), b"payload")
    for rel in ("../../../escaped.txt", "/tmp/absolute.txt"):
        remote.fs.pipe_file(
            remote._path(name, "MANIFEST.json"),
            json.dumps({"files": {rel: {"size": 7, "sha256": "0" * 64}}}).encode(),
        )
        local = tmp_path / "fresh" / "checkpoints"
        local.mkdir(parents=True, exist_ok=True)
        path, why = remote.download(2, local)
        assert path is None and "outside the checkpoint directory" in why
        assert not any((tmp_path / "fresh").rglob("escaped.txt")) and not (tmp_path / "escaped.txt").exists()
    notes = []
    assert ckpt.resume_point(tmp_path / "empty", remote, log=notes.append).step == 1
    assert any("step_000002" in n and "outside" in n for n in notes)


REMOTE_WRONG_MANIFESTS = {
    "a list": b"[]",
    "files null": b'{"files": null}',
    "files a list": b'{"files": ["rng.pt"]}',
    "an entry not a mapping": b'{"files": {"x": 5}}',
    "not JSON": b"<Error>NoSuchKey</Error>",
    "not UTF-8": b"\x89PNG\r\n\x1a\n\xff",
    "no files at all": b'{"files": {}}',
}


@pytest.mark.parametrize("store", ["memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_remote_manifest_of_any_wrong_shape_is_named_and_skipped(tmp_path, parts, store, request):  # noqa: F811
    """A bucket can hold anything under MANIFEST.json: each wrong shape is a corrupt checkpoint (the resume
    takes the one before), never a traceback."""
    if store == "s3":
        endpoint = request.getfixturevalue("s3_server")
        remote = ckpt.RemoteStore(
            "s3://tempering-ckpt/shapes",
            {"endpoint_url": endpoint, "key": "test", "secret": "test", "region": "us-east-1"},
            retries=0,
            backoff_s=0.01,
        )
    else:
        remote = ckpt.RemoteStore("memory://runs/shapes", retries=0, backoff_s=0.01)
    saver = ckpt.Saver(tmp_path / "local", keep=5, remote=remote, asynchronous=False)
    for step in (1, 2):
        saver.save(snap(step, parts))
    saver.close()
    for shape, content in REMOTE_WRONG_MANIFESTS.items():
        remote.fs.pipe_file(remote._path("step_000002", "MANIFEST.json"), content)
        notes = []
        got = ckpt.resume_point(tmp_path / "fresh" / shape, remote, log=notes.append)
        assert got is not None and got.step == 1, shape
        assert any("remote checkpoint step_000002 skipped: MANIFEST.json" in n for n in notes), (shape, notes)
        assert not (tmp_path / "fresh" / shape / "step_000002").exists()


class Flaky:
    """Wraps an fsspec filesystem: the first `failures` writes raise, as during a storage outage."""

    def __init__(self, fs, failures):
        self.fs, self.failures = fs, failures

    def __getattr__(self, name):
        attr = getattr(self.fs, name)
        if name not in ("put_file", "pipe_file"):
            return attr

        def call(*a, **kw):
            if self.failures > 0:
                self.failures -= 1
                raise ConnectionError("storage is down")
            return attr(*a, **kw)

        return call


def test_a_storage_outage_is_reported_training_continues_and_the_next_save_uploads(tmp_path, parts):  # noqa: F811
    remote = ckpt.RemoteStore("memory://runs/c", retries=1, backoff_s=0.01)
    remote.fs = Flaky(remote.fs, failures=2)
    saver = ckpt.Saver(tmp_path, keep=3, remote=remote, log=lambda m: None)
    saver.save(snap(1, parts))
    saver.wait()
    deadline = time.monotonic() + 10
    while not saver.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.errors and "kept locally" in saver.errors[0]
    assert ckpt.verify(tmp_path / "step_000001") is None  # the local copy is intact
    saver.save(snap(2, parts))
    saver.close()
    assert remote.steps()[0] == 2 and remote.has_manifest(2)


def test_remote_store_errors_name_the_uri():
    with pytest.raises(CheckpointError, match="nosuchproto://x"):
        ckpt.RemoteStore("nosuchproto://x")


# ------------------------------------------------------------------------------ end to end (slow)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible server (moto) on loopback, started and stopped here."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=endpoint)
    fs.mkdir("tempering-ckpt")
    yield endpoint
    server.stop()


def s3_overrides(endpoint, prefix):
    return [
        f"checkpoint.uri=s3://tempering-ckpt/{prefix}",
        f"checkpoint.storage.endpoint_url={endpoint}",
        "checkpoint.storage.key=test",
        "checkpoint.storage.secret=test",
        "checkpoint.storage.region=us-east-1",
    ]


@pytest.mark.slow
@pytest.mark.s3
def test_s3_mirror_and_resume_from_s3_after_losing_the_disk(s3_server, tmp_path):
    reference = tmp_path / "ref"
    tempering("train", "configs/smoke.yaml", f"run.dir={reference}")
    run_dir = tmp_path / "s3run"
    extra = s3_overrides(s3_server, "run1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tempering.cli", "train", "configs/smoke.yaml", f"run.dir={run_dir}", *extra],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import s3fs

    fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=s3_server)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        fs.invalidate_cache()
        if fs.exists("tempering-ckpt/run1/step_000004/MANIFEST.json"):
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    import shutil

    shutil.rmtree(run_dir / "checkpoints")  # the machine's disk is gone; only the bucket is left
    out = tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *extra)
    assert "downloaded step_00000" in out.stdout + out.stderr
    assert stable(metrics(run_dir)) == stable(metrics(reference))


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_the_same_command_resumes(tmp_path):
    reference = tmp_path / "ref"
    tempering("train", "configs/smoke.yaml", f"run.dir={reference}")
    run_dir = tmp_path / "preempted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tempering.cli", "train", "configs/smoke.yaml", f"run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    rows = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if rows.is_file() and len(rows.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "preempted" in err
    done = len(metrics(run_dir))
    assert (run_dir / "checkpoints" / f"step_{done:06d}").is_dir()  # saved at the step it stopped after
    assert not (run_dir / "summary.json").exists()
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}")
    assert stable(metrics(run_dir)) == stable(metrics(reference))


@pytest.mark.slow
def test_export_writes_a_plain_hf_directory(tmp_path):
    run_dir = tmp_path / "run"
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", "train.steps=2", "eval.every=0")
    out = tmp_path / "exported"
    tempering("export", run_dir / "checkpoints" / "step_000002", "--to", out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.num_parameters() > 0 and (out / "tokenizer.json").is_file()
    bad = tempering("export", tmp_path / "nope", "--to", tmp_path / "x", check=False)
    assert bad.returncode == 2 and "nope" in bad.stderr


@pytest.mark.slow
def test_resume_across_an_epoch_boundary_is_exact(tmp_path):
    # 20 training tasks, 4 per step: an epoch every 5 steps; killed after checkpoint 6, i.e. in epoch 2.
    extra = ["data.num_train=20", "train.steps=9", "checkpoint.every=3", "eval.every=0"]
    reference = tmp_path / "ref"
    tempering("train", "configs/smoke.yaml", f"run.dir={reference}", *extra)
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(run_dir, 6, *extra)
    state = json.loads((run_dir / "checkpoints" / "step_000006" / "trainer_state.json").read_text())
    assert state["sampler"]["epoch"] == 1  # the checkpoint is past the first epoch boundary
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *extra)
    assert stable(metrics(run_dir)) == stable(metrics(reference))


@pytest.mark.slow
def test_a_wrong_shaped_manifest_is_skipped_on_resume_and_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    train_tiny(run_dir, "train.steps=2")
    (run_dir / "checkpoints" / "step_000002" / "MANIFEST.json").write_text('{"files": {"config.yaml": 5}}')
    proc = train_tiny(run_dir, "train.steps=3")
    assert "checkpoint step_000002 skipped: MANIFEST.json" in proc.stderr and "Traceback" not in proc.stderr
    assert "resuming from step_000001" in proc.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


@pytest.mark.slow
def test_a_resume_that_fails_leaves_config_yaml_and_its_history_untouched(tmp_path):
    """The newest checkpoint was saved under another algo.lr (its manifest is valid): resuming from it is
    refused - before config.yaml is rewritten with the new train.steps or the change is recorded."""
    from tempering.checkpoint import write_manifest

    run_dir = tmp_path / "run"
    train_tiny(run_dir, "train.steps=2")
    newest = run_dir / "checkpoints" / "step_000002"
    (newest / "config.yaml").write_text(
        (newest / "config.yaml").read_text().replace("lr: 0.0001", "lr: 0.0005", 1)
    )
    write_manifest(newest)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = train_tiny(run_dir, "train.steps=3", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "checkpoint step_000002" in proc.stderr and "algo.lr 0.0005 -> 0.0001" in proc.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert not (run_dir / "config_history").exists()


# ------------------------------------------------------------------------------------- a full disk (slow)


@pytest.fixture()
def small_disk(tmp_path):
    """A 32 MiB tmpfs of its own (a tiny run needs about 5), so the test can fill it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill_before_row(monkeypatch, disk, step, leave):
    """Fill `disk` to `leave` bytes free just before the row of `step` is written, once (checkpoint step - 1
    is complete: saves are synchronous in these runs)."""
    from tempering.tracking import Tracker

    log, filled = Tracker.log, []

    def fill_then_log(self, s, metrics):
        if s == step and not filled:
            filled.append(s)
            with open(disk / "filler", "wb") as f:
                f.truncate(0)
                left = shutil.disk_usage(disk).free - leave
                while left > 0:
                    f.write(b"\0" * min(left, 1 << 20))
                    left -= 1 << 20
        return log(self, s, metrics)

    monkeypatch.setattr(Tracker, "log", fill_then_log)


def train_here(run_dir) -> int:
    from tempering.cli import main
    from tests.helpers.runs import TINY

    return main(
        [
            "train",
            str(ROOT / "configs" / "smoke.yaml"),
            f"run.dir={run_dir}",
            *TINY,
            "train.steps=4",
            "checkpoint.async_save=false",
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("leave_kib", [256, 1024], ids=["the model's safetensors fail", "torch.save fails"])
def test_a_full_disk_fails_each_checkpoint_with_one_warning_and_training_goes_on(
    small_disk, monkeypatch, capsys, leave_kib
):
    """Room for rows, none for a checkpoint: steps 3 and 4 are trained and logged, each save says the disk is
    full (torch alone says "unexpected pos"); the run ends with one line, as the evaluation after RL needs the
    final checkpoint; LATEST still names step 2, from which the same command finishes the run exactly."""
    monkeypatch.setenv("COLUMNS", "1000")  # the console's lines unwrapped
    run_dir, where = small_disk / "run", small_disk / "run" / "checkpoints"
    fill_before_row(monkeypatch, small_disk, 3, leave=leave_kib << 10)
    assert train_here(run_dir) == 2
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "not saved" in line and not line.startswith("error:")]
    assert len(warnings) == 2, err
    for step, line in zip((3, 4), warnings):
        assert re.fullmatch(
            rf"checkpoint step {step} not saved: the disk is full at {re.escape(str(where))} "
            r"\([0-9.]+ MiB free\); LATEST still names step_000002",
            line,
        ), line
    assert "Traceback" not in err and "unexpected pos" not in err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert "the disk is full" in error and "final checkpoint" in error
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # training went on
    assert (where / "LATEST").read_text().strip() == "step_000002" and ckpt.verify(
        where / "step_000002"
    ) is None
    assert not list(where.glob("*.tmp"))  # the half checkpoints gave their space back
    (small_disk / "filler").unlink()
    assert train_here(run_dir) == 0
    assert stable(metrics(run_dir)) == stable(rows)


@pytest.mark.slow
def test_a_full_disk_under_the_metrics_stops_the_run_with_one_error_line(small_disk, monkeypatch, capsys):
    from tempering.tracking import read_metrics

    run_dir, where = small_disk / "run", small_disk / "run" / "checkpoints"
    fill_before_row(monkeypatch, small_disk, 3, leave=0)
    assert train_here(run_dir) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: disk full writing {run_dir}/"), error
    assert (where / "LATEST").read_text().strip() == "step_000002" and ckpt.verify(
        where / "step_000002"
    ) is None
    rows = read_metrics(run_dir / "metrics.jsonl")[:2]
    (small_disk / "filler").unlink()
    assert train_here(run_dir) == 0
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4] and metrics(run_dir)[:2] == rows
