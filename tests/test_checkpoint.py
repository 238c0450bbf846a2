import json
import random

import numpy as np
import pytest
import torch

from tempering import checkpoint as ckpt
from tempering.errors import CheckpointError
from tempering.training.optim import make_optimizer, make_scheduler


def save(root, step, parts, keep=3):
    model, tokenizer, opt, sched = parts
    return ckpt.save_checkpoint(
        root,
        step,
        model=model,
        tokenizer=tokenizer,
        optimizer=opt,
        scheduler=sched,
        trainer_state={"sampler": {"epoch": 1, "position": step}},
        config_yaml="a: 1\n",
        keep=keep,
    )


def test_save_writes_the_layout_and_latest(tmp_path, parts):
    c = save(tmp_path, 4, parts)
    names = {p.name for p in c.path.iterdir()}
    assert {
        "model",
        "optimizer.pt",
        "scheduler.pt",
        "rng.pt",
        "trainer_state.json",
        "config.yaml",
        "MANIFEST.json",
    } <= names
    assert (tmp_path / "LATEST").read_text().strip() == "step_000004"
    assert ckpt.verify(c.path) is None
    assert json.loads((c.path / "trainer_state.json").read_text())["step"] == 4


def test_restore_brings_back_optimizer_scheduler_and_rng(tmp_path, parts):
    model, tokenizer, opt, sched = parts
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    c = save(tmp_path, 2, parts)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    fresh_opt = make_optimizer(model, lr=1e-3)
    fresh_sched = make_scheduler(fresh_opt, warmup_steps=3, total_steps=10)
    state = c.load_into(fresh_opt, fresh_sched)
    assert state["sampler"] == {"epoch": 1, "position": 2}
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert fresh_sched.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_corrupt_and_partial_checkpoints_are_named_and_skipped(tmp_path, parts):
    save(tmp_path, 2, parts)
    save(tmp_path, 4, parts)
    c6 = save(tmp_path, 6, parts)
    with (c6.path / "optimizer.pt").open("r+b") as f:  # flip bytes in the newest
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    (tmp_path / "step_000004" / "MANIFEST.json").unlink()  # a save that never finished
    found, skipped = ckpt.find_latest(tmp_path)
    assert found.step == 2
    assert any("step_000006" in s and "checksum" in s for s in skipped)
    assert any("step_000004" in s and "MANIFEST" in s for s in skipped)
    with pytest.raises(CheckpointError, match="step_000006.*checksum"):
        ckpt.require(c6.path)


def test_truncated_file_is_detected(tmp_path, parts):
    c = save(tmp_path, 1, parts)
    weights = c.path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "bytes" in ckpt.verify(c.path)
    assert ckpt.find_latest(tmp_path)[0] is None


def test_retention_keeps_newest_and_leftover_tmp_is_ignored(tmp_path, parts):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, parts, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]
    (tmp_path / "step_000009.tmp").mkdir()  # a crash mid-save leaves this behind
    assert ckpt.find_latest(tmp_path)[0].step == 4


WRONG_MANIFESTS = {
    "a list": b"[]",
    "null": b"null",
    "a string": b'"files"',
    "files null": b'{"files": null}',
    "files a list": b'{"files": ["model/config.json", "optimizer.pt"]}',
    "an entry not a mapping": b'{"files": {"x": 5}}',
    "a size that is a string": b'{"files": {"rng.pt": {"size": "12", "sha256": "' + b"0" * 64 + b'"}}}',
    "no checksum": b'{"files": {"rng.pt": {"size": 12}}}',
    "no files at all": b'{"files": {}}',
    "not JSON": b"{'files': ",
    "not UTF-8": b"\xff\xfe\x00",
    "no files key": b"{}",
}


@pytest.mark.parametrize("content", WRONG_MANIFESTS.values(), ids=WRONG_MANIFESTS.keys())
def test_a_manifest_of_any_wrong_shape_is_a_corrupt_checkpoint_named_and_skipped(tmp_path, parts, content):
    save(tmp_path, 2, parts)
    c4 = save(tmp_path, 4, parts)
    (c4.path / "MANIFEST.json").write_bytes(content)
    notes = []
    found = ckpt.resume_point(tmp_path, None, log=notes.append)
    assert found.step == 2
    [note] = notes
    assert "checkpoint step_000004 skipped: MANIFEST.json" in note and "\n" not in note
    with pytest.raises(CheckpointError, match="step_000004.*MANIFEST.json"):
        ckpt.require(c4.path)


def test_a_manifest_that_leaves_out_a_file_every_checkpoint_has_is_corrupt(tmp_path, parts):
    """A resume loads optimizer.pt, scheduler.pt, rng.pt...: a manifest that lists less describes no checkpoint
    (verifying only what it lists would pass, and the load would crash)."""
    c = save(tmp_path, 2, parts)
    manifest = json.loads((c.path / "MANIFEST.json").read_text())
    del manifest["files"]["optimizer.pt"]
    (c.path / "MANIFEST.json").write_text(json.dumps(manifest))
    assert ckpt.verify(c.path) == "MANIFEST.json does not list 'optimizer.pt' (every checkpoint has it)"


def test_a_failed_saves_message_keeps_its_brackets_on_the_console(tmp_path, monkeypatch):
    """Torch's writer says "[enforce fail at ...]": Rich read that as markup and dropped it from the warning."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from tempering.checkpoint import saver as saver_module

    def full(*_, **__):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096")

    monkeypatch.setattr(saver_module, "write_snapshot", full)
    out = io.StringIO()
    console = Console(file=out, width=200)
    saver_module.Saver(tmp_path, asynchronous=False, log=console.print).save(SimpleNamespace(step=3))
    assert "saving step 3 failed: RuntimeError: [enforce fail at inline_container.cc:664]" in out.getvalue()
