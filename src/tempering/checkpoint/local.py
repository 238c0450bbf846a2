"""Local checkpoints: everything that shapes the rest of a run, written so that a crash never leaves a half one.

Layout (docs/reference/run-directory.md):

    checkpoints/step_NNNNNN/   model/ (HF format), optimizer.pt, scheduler.pt, rng.pt,
                               trainer_state.json, config.yaml, MANIFEST.json
    checkpoints/LATEST         names the newest complete checkpoint; written last

A checkpoint is assembled in `step_NNNNNN.tmp/`, its MANIFEST (size and sha256 of every file) written
after the data, then renamed into place, and only then is LATEST replaced. On resume a checkpoint counts
only if its manifest verifies; a corrupt or partial one is reported by name and the previous one used.
"""

from __future__ import annotations

import copy
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

from tempering.errors import CheckpointError, DiskFullError, disk_full, free_bytes
from tempering.files import write_atomic
from tempering.models.lora import adapter_state, is_adapter_dir
from tempering.models.registry import sha256 as _sha256

MANIFEST = "MANIFEST.json"
LATEST = "LATEST"
CORE_FILES = ("config.yaml", "optimizer.pt", "rng.pt", "scheduler.pt", "trainer_state.json", "model/")
"""What every checkpoint has (`model/`: some file in it): a manifest that does not list one describes no
checkpoint (a resume would fail loading it, a download would fetch too little)."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def write_manifest(directory: Path) -> dict[str, Any]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(directory).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"files": files}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def parse_manifest(data: bytes) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """A manifest's `files` ({relative path: {"size": int, "sha256": hex}}), or (None, what is wrong with it).
    A manifest is input (a disk can corrupt it, a bucket can hold anything): any other shape is a corrupt
    checkpoint, never an exception."""
    try:
        manifest = json.loads(data)
    except ValueError:  # also bytes that are not UTF-8
        return None, "MANIFEST.json is not JSON"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return None, 'MANIFEST.json has no "files" mapping'
    if bad := outside_names(files):
        return None, f"MANIFEST.json names '{bad[0]}', outside the checkpoint directory"
    for rel, meta in files.items():
        if not _is_file_entry(meta):
            return (
                None,
                f'MANIFEST.json\'s entry for \'{rel}\' is not {{"size": bytes, "sha256": hex digest}}',
            )
    if missing := [name for name in CORE_FILES if not _lists(files, name)]:
        return None, f"MANIFEST.json does not list '{missing[0]}' (every checkpoint has it)"
    return files, None


def _lists(files: dict[str, Any], name: str) -> bool:
    """Whether `files` has `name`, or for a directory name (`model/`), a file in it."""
    return name in files if not name.endswith("/") else any(rel.startswith(name) for rel in files)


def _is_file_entry(meta: Any) -> bool:
    size, digest = (meta.get("size"), meta.get("sha256")) if isinstance(meta, dict) else (None, None)
    return (
        type(size) is int
        and size >= 0
        and isinstance(digest, str)
        and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest)
    )


def verify(directory: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no MANIFEST.json (the save did not finish)"
    try:
        files, problem = parse_manifest(manifest_path.read_bytes())
    except OSError as e:
        return f"MANIFEST.json cannot be read ({e.strerror or e})"
    if problem:
        return problem
    for rel, meta in files.items():
        path = directory / rel
        if not path.is_file():
            return f"'{rel}' is missing"
        if path.stat().st_size != meta["size"]:
            return f"'{rel}' has {path.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(path) != meta["sha256"]:
            return f"'{rel}' does not match its checksum"
    return None


def outside_names(names) -> list[str]:
    """The manifest entries that would not stay inside the checkpoint directory (absolute, `..`, empty):
    a manifest from object storage is input, and must not make a download write anywhere else."""
    bad = []
    for rel in names:
        parts = Path(rel).parts if isinstance(rel, str) else ()
        if not parts or Path(rel).is_absolute() or ".." in parts or "\\" in rel:
            bad.append(str(rel))
    return bad


# --------------------------------------------------------------------------------------------- RNG


def cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached copy of a state dict on the CPU: a save in flight holds no accelerator memory, and the
    checkpoint loads on any machine."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


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
        optimizer.load_state_dict(
            torch.load(self.path / "optimizer.pt", map_location="cpu", weights_only=False)
        )
        scheduler.load_state_dict(
            torch.load(self.path / "scheduler.pt", map_location="cpu", weights_only=False)
        )
        set_rng_state(torch.load(self.path / "rng.pt", weights_only=False))
        return self.trainer_state()


@dataclass
class Snapshot:
    """Everything a checkpoint holds, copied out of the live objects, so it can be written while training
    goes on: tensors are cloned; the model and tokenizer are only read for their config and files."""

    step: int
    model: torch.nn.Module
    model_state: dict[str, torch.Tensor]
    tokenizer: Any
    optimizer_state: dict[str, Any]
    scheduler_state: dict[str, Any]
    rng: dict[str, Any]
    trainer_state: dict[str, Any]
    config_yaml: str
    extra: Callable[[Path], None] | None = None


def snapshot(
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    trainer_state: dict[str, Any],
    config_yaml: str,
    extra: Callable[[Path], None] | None = None,
) -> Snapshot:
    from tempering import __version__

    return Snapshot(
        step=step,
        model=model,
        model_state=cpu_copy(adapter_state(model)),
        tokenizer=tokenizer,
        optimizer_state=copy.deepcopy(optimizer.state_dict()),
        scheduler_state=copy.deepcopy(scheduler.state_dict()),
        rng=rng_state(),
        trainer_state={"step": step, "tempering_version": __version__, **copy.deepcopy(trainer_state)},
        config_yaml=config_yaml,
        extra=extra,
    )


def write_snapshot(
    root: Path,
    snap: Snapshot,
    *,
    keep: int = 2,
    keep_every: int | None = None,
    protect: frozenset[str] = frozenset(),
) -> Checkpoint:
    """Write checkpoint `snap.step` under `root` atomically, point LATEST at it, prune old ones."""
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(snap.step)
    tmp, final = root / f"{name}.tmp", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_files(tmp, snap)
    except Exception as e:
        full = disk_full(e, tmp)  # asked before the half checkpoint gives its space back
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(
                f"the disk is full at {root} ({free_bytes(root) / 2**20:.1f} MiB free)"
            ) from e
        raise
    if final.exists():  # re-saving a step after a resume: the new copy replaces the old
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_atomic(root / LATEST, name + "\n")
    prune(root, keep, keep_every, protect)
    return Checkpoint(final, snap.step)


def _write_files(tmp: Path, snap: Snapshot) -> None:
    tmp.mkdir()
    snap.model.save_pretrained(tmp / "model", state_dict=snap.model_state, safe_serialization=True)
    snap.tokenizer.save_pretrained(tmp / "model")
    torch.save(snap.optimizer_state, tmp / "optimizer.pt")
    torch.save(snap.scheduler_state, tmp / "scheduler.pt")
    torch.save(snap.rng, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(snap.trainer_state, indent=1))
    (tmp / "config.yaml").write_text(snap.config_yaml)
    if snap.extra is not None:  # more state (e.g. the critic) written into the checkpoint before its manifest
        snap.extra(tmp)
    write_manifest(tmp)
    _fsync_tree(tmp)


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
    keep_every: int | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Checkpoint:
    """Snapshot and write at once (the synchronous path)."""
    snap = snapshot(
        step,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=trainer_state,
        config_yaml=config_yaml,
        extra=extra,
    )
    return write_snapshot(root, snap, keep=keep, keep_every=keep_every)


def _fsync_tree(directory: Path) -> None:
    """Flush the files to disk before the rename publishes them (a power cut must not publish zeros)."""
    for path in directory.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def parse_step(name: str) -> int | None:
    if not name.startswith("step_") or "." in name:
        return None
    try:
        return int(name.split("_", 1)[1])
    except ValueError:
        return None


def _steps(root: Path) -> list[tuple[int, Path]]:
    found = []
    for p in root.glob("step_*"):
        step = parse_step(p.name)
        if p.is_dir() and step is not None:
            found.append((step, p))
    return sorted(found, reverse=True)


def retained(step: int, steps: list[int], keep: int, keep_every: int | None) -> bool:
    """Retention (here and in the remote mirror): the newest `keep` steps, plus every multiple of `keep_every`."""
    newest = sorted(steps, reverse=True)[: max(1, keep)]
    return step in newest or bool(keep_every and step % keep_every == 0)


def prune(
    root: Path, keep: int, keep_every: int | None = None, protect: frozenset[str] = frozenset()
) -> None:
    """Keep the newest `keep` checkpoints plus every `keep_every`-th step; never delete the one LATEST
    names, the newest one that verifies, or those in `protect` (e.g. one being uploaded)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    steps = _steps(root)
    doomed = [
        (s, p)
        for s, p in steps
        if not retained(s, [x for x, _ in steps], keep, keep_every)
        and p.name != latest
        and p.name not in protect
    ]
    if doomed:
        newest_valid = next((p for _, p in steps if verify(p) is None), None)
        for _, path in doomed:
            if path != newest_valid:
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


def model_dir_of(path: Path) -> Path:
    """The model a path names: a model directory (or a LoRA adapter directory) itself, a checkpoint
    directory's model/, or a run directory's newest checkpoint's model/ (else `path`, for the loader's error)."""
    if (path / "config.json").is_file() or is_adapter_dir(path):
        return path
    if (path / MANIFEST).is_file():
        return require(path).model_dir
    if (path / "checkpoints").is_dir():
        latest, _ = find_latest(path / "checkpoints")
        if latest:
            return latest.model_dir
    return path


def resolve_model(spec: str | Path) -> Path:
    """The model directory a command's MODEL argument names - the same forms everywhere (`train`'s
    model.path, `eval`, `export`, `serve`, `repair`): a registry name (prepared once into the cache), a
    model or LoRA adapter directory, a checkpoint directory (its model/), or a run directory (its newest
    checkpoint's model/). A path that is none of these is a ModelLoadError naming it."""
    from tempering.models.loading import check_model_dir
    from tempering.models.registry import MODELS, prepare

    if str(spec) in MODELS and not Path(spec).exists():
        return prepare(str(spec))
    return check_model_dir(model_dir_of(Path(spec)))


def owner_config(model_dir: Path) -> Path | None:
    """The config.yaml of the run or checkpoint that `model_dir` is, or whose model it is (CKPT/model,
    RUN/sft/model, RUN/base, RUN/start); None for anything else: a config.yaml that merely lies nearby (a
    parent directory, the working directory) belongs to something else and is never read."""
    path = Path(model_dir).resolve()
    for owner, rel in (
        (path, None),
        (path.parent, "model"),
        (path.parent, "base"),
        (path.parent, "start"),
        (path.parent.parent, "sft/model"),
    ):
        if rel is not None and path != owner / rel:
            continue
        is_checkpoint = (owner / MANIFEST).is_file()
        is_run = (owner / "checkpoints").is_dir() or (owner / "data" / "heldout.jsonl").is_file()
        if (is_checkpoint or is_run) and (owner / "config.yaml").is_file():
            return owner / "config.yaml"
    return None
