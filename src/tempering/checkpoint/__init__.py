"""Checkpoints: everything that shapes the rest of a run, written so that a crash never leaves a half one,
optionally mirrored to object storage, saved while training goes on.

    local.py    the layout, atomic writes, MANIFEST verification, retention, RNG state
    remote.py   the fsspec mirror (s3://, memory://, any path), with retries
    saver.py    the asynchronous saver and the resume point (newest valid, local or remote)

Layout (docs/reference/run-directory.md):

    checkpoints/step_NNNNNN/   model/ (HF format), optimizer.pt, scheduler.pt, rng.pt,
                               trainer_state.json, config.yaml, [critic/], MANIFEST.json
    checkpoints/LATEST         names the newest complete checkpoint; written last
"""

from tempering.checkpoint.local import (
    LATEST,
    MANIFEST,
    Checkpoint,
    Snapshot,
    checkpoint_name,
    cpu_copy,
    find_latest,
    model_dir_of,
    outside_names,
    owner_config,
    parse_manifest,
    prune,
    require,
    resolve_model,
    retained,
    rng_state,
    save_checkpoint,
    set_rng_state,
    snapshot,
    verify,
    write_manifest,
    write_snapshot,
)
from tempering.checkpoint.remote import RemoteStore
from tempering.checkpoint.saver import Saver, resume_point

__all__ = [
    "LATEST",
    "MANIFEST",
    "Checkpoint",
    "RemoteStore",
    "Saver",
    "Snapshot",
    "checkpoint_name",
    "cpu_copy",
    "find_latest",
    "model_dir_of",
    "outside_names",
    "owner_config",
    "parse_manifest",
    "prune",
    "require",
    "resolve_model",
    "resume_point",
    "retained",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "snapshot",
    "verify",
    "write_manifest",
    "write_snapshot",
]
