"""Checkpoints: everything that shapes the rest of a run, written so that a crash never leaves a half one.

Layout (DESIGN.md, "Run directory"):

    checkpoints/step_NNNNNN/   model/ (HF format), optimizer.pt, scheduler.pt, rng.pt,
                               trainer_state.json, config.yaml, MANIFEST.json
    checkpoints/LATEST         names the newest complete checkpoint; written last

A checkpoint is assembled in `step_NNNNNN.tmp/`, its MANIFEST (size and sha256 of every file) written
after the data, then renamed into place, and only then is LATEST replaced. On resume a checkpoint counts
only if its manifest verifies; a corrupt or partial one is reported by name and the previous one used.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tempering.errors import CheckpointError

MANIFEST = "MANIFEST.json"
LATEST = "LATEST"


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path) -> dict[str, Any]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(directory).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"files": files}
    _write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def verify(directory: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no MANIFEST.json (the save did not finish)"
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError):
        return "MANIFEST.json is unreadable"
    for rel, meta in files.items():
        path = directory / rel
        if not path.is_file():
            return f"'{rel}' is missing"
        if path.stat().st_size != meta["size"]:
            return f"'{rel}' has {path.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(path) != meta["sha256"]:
            return f"'{rel}' does not match its checksum"
    return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


# ------------------------------------------------------------------------------------- save / load


@dataclass
class Checkpoint:
    path: Path
    step: int

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    def trainer_state(self) -> dict[str, Any]:
        return json.loads((self.path / "trainer_state.json").read_text())

    def load_into(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
        """Restore optimizer, scheduler and global RNG states; returns the trainer state."""
        optimizer.load_state_dict(torch.load(self.path / "optimizer.pt", weights_only=False))
        scheduler.load_state_dict(torch.load(self.path / "scheduler.pt", weights_only=False))
        set_rng_state(torch.load(self.path / "rng.pt", weights_only=False))
        return self.trainer_state()


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    config_yaml: str,
    keep: int = 2,
    extra: Callable[[Path], None] | None = None,
) -> Checkpoint:
    """Write checkpoint `step` under `root` atomically, point LATEST at it, prune old ones."""
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    tmp, final = root / f"{name}.tmp", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    (tmp / "config.yaml").write_text(config_yaml)
    if extra is not None:  # more state (e.g. the critic) written into the checkpoint before its manifest
        extra(tmp)
    write_manifest(tmp)
    if final.exists():  # re-saving a step after a resume: the new copy replaces the old
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / LATEST, name + "\n")
    prune(root, keep)
    return Checkpoint(final, step)


def _steps(root: Path) -> list[tuple[int, Path]]:
    found = []
    for p in root.glob("step_*"):
        if p.is_dir() and not p.name.endswith(".tmp"):
            try:
                found.append((int(p.name.split("_", 1)[1]), p))
            except ValueError:
                continue
    return sorted(found, reverse=True)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints; never the one LATEST names."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    for i, (_, path) in enumerate(_steps(root)):
        if i >= max(1, keep) and path.name != latest:
            shutil.rmtree(path, ignore_errors=True)


def find_latest(root: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint under `root` whose manifest verifies, and a note for every newer one skipped.

    Normally that is the one LATEST names; a checkpoint renamed into place just before a crash, LATEST not
    yet rewritten, is complete and verified, so it is used too.
    """
    skipped: list[str] = []
    for step, path in _steps(root) if root.is_dir() else []:
        problem = verify(path)
        if problem is None:
            return Checkpoint(path, step), skipped
        skipped.append(f"checkpoint {path.name} skipped: {problem}")
    return None, skipped


def require(path: Path) -> Checkpoint:
    """A specific checkpoint directory, verified (for `tempering eval` / `export`)."""
    problem = verify(path)
    if problem:
        raise CheckpointError(f"checkpoint '{path}' is not usable: {problem}")
    try:
        step = json.loads((path / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        step = -1
    return Checkpoint(path, step)
