"""What a resumed run may change in its config, and the record of every change.

A run directory keeps the config it was made with (RUN_DIR/config.yaml; every checkpoint holds a copy).
`tempering train` on an existing run directory compares the new config with it. Keys in `MUTABLE` may
change freely: they say how long to train, where and how fast, and how to log and save, never what is
trained. Any other difference is refused with one line naming the differing keys, unless the user passes
`--allow-config-change`. Every change, free or forced, is recorded: the previous config.yaml is kept as
RUN_DIR/config_history/NNNN.yaml and a line of RUN_DIR/config_history/changes.jsonl names each changed
key with its old and new value (summary.json repeats these lines as `config_changes`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tempering.config import RunConfig, _section_at
from tempering.errors import ConfigError
from tempering.files import write_atomic

MUTABLE: tuple[str, ...] = (
    "run.dir",  # a run directory may be moved or copied
    "run.threads",  # speed only (resumed numbers match to float rounding, not bit for bit)
    "run.device",  # e.g. resume a CPU run on a GPU machine (same caveat)
    "train.steps",  # train longer (the eval after RL is recomputed for the new final step)
    "train.max_time_s",  # a per-invocation budget
    "checkpoint",  # how often, how many, where and how checkpoints are saved
    "tracking",  # TensorBoard, samples, progress bar
    "eval.every",  # periodic validation is monitoring only
    "eval.val_tasks",
    "sandbox.workers",  # parallelism of the same executions
    "sandbox.url",  # the same executions on a service
    "distributed",  # where rollouts run (same samples anywhere); trainers: M (floats to rounding)
    "rollout.workers",  # how many workers run the (fixed) shards
    "rollout.min_workers",
    "rollout.max_workers",
    "rollout.worker_cpus",
)
"""Keys (or whole sections) a resumed run may change without `--allow-config-change`."""

HISTORY = "config_history"
_UNSET = "<unset>"


def is_mutable(key: str) -> bool:
    return any(key == m or key.startswith(m + ".") for m in MUTABLE)


@dataclass
class ConfigChange:
    """The difference between the config a run directory recorded and the one it is resumed with."""

    previous_yaml: str
    changed: dict[str, tuple[Any, Any]]
    """Dotted key -> (old value, new value), for every key that differs."""
    forced: list[str]
    """The changed keys outside `MUTABLE` (accepted only with --allow-config-change)."""

    def describe(self, keys: list[str] | None = None) -> str:
        return ", ".join(
            f"{k} {_short(self.changed[k][0])} -> {_short(self.changed[k][1])}"
            for k in (keys if keys is not None else list(self.changed))
        )


def _short(value: Any, limit: int = 40) -> str:
    text = _UNSET if value == _UNSET else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'algo': {'lr': 1e-4}} -> {'algo.lr': 1e-4}; dict-valued fields are flattened too (their entries)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _with_defaults(tree: dict[str, Any], defaults: dict[str, Any], path: list[str]) -> dict[str, Any]:
    """A stored config over today's defaults, section by section: a key added to the code since the run
    was made reads as its default, not as a change (dict-valued fields are taken whole)."""
    out = dict(defaults)
    for key, value in tree.items():
        here = [*path, str(key)]
        if isinstance(value, dict) and isinstance(out.get(key), dict) and _section_at(here) is not None:
            out[key] = _with_defaults(value, out[key], here)
        else:
            out[key] = value
    return out


def _flat(text: str, where: str) -> dict[str, Any]:
    """A stored config (YAML text) as dotted key -> value, over today's defaults."""
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"{where} is not valid YAML ({getattr(e, 'problem', e)}); move it aside to start over"
        ) from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{where} does not hold a config mapping; move it aside to start over")
    return flatten(_with_defaults(tree, RunConfig().model_dump(), []))


def _diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {
        k: (old.get(k, _UNSET), new.get(k, _UNSET))
        for k in sorted(set(old) | set(new))
        if old.get(k, _UNSET) != new.get(k, _UNSET)
    }


def changes(previous_yaml: str, cfg: RunConfig, where: str) -> ConfigChange | None:
    """The difference between a stored config (YAML text) and `cfg`, or None when they agree."""
    changed = _diff(_flat(previous_yaml, where), flatten(cfg.model_dump()))
    if not changed:
        return None
    return ConfigChange(previous_yaml, changed, [k for k in changed if not is_mutable(k)])


def _refusal(run_dir: Path, change: ConfigChange, what: str) -> ConfigError:
    return ConfigError(
        f"run.dir '{run_dir}' was made with a different config ({what}): {change.describe(change.forced)}; "
        f"only {', '.join(MUTABLE)} may change on resume - use a new run.dir, or pass --allow-config-change "
        f"to continue with the new values (the old config is kept in {run_dir / HISTORY})"
    )


def check_resume(run_dir: Path, cfg: RunConfig, allow: bool) -> ConfigChange | None:
    """Compare `cfg` with the config the run directory recorded (its config.yaml, else its newest local
    checkpoint's); refuse a change outside MUTABLE unless `allow`. Reads only: nothing is written."""
    from tempering import checkpoint as ckpt

    stored = run_dir / "config.yaml"
    if not stored.is_file():
        latest, _ = ckpt.find_latest(run_dir / "checkpoints")
        stored = latest.path / "config.yaml" if latest else stored
    if not stored.is_file():
        return None
    change = changes(stored.read_text(), cfg, str(stored))
    if change is not None and change.forced and not allow:
        raise _refusal(run_dir, change, "config.yaml")
    return change


def check_checkpoint(
    run_dir: Path, checkpoint_dir: Path, cfg: RunConfig, allow: bool, vetted: str | None = None
) -> ConfigChange | None:
    """The same check against the checkpoint a run resumes from (it may come from `checkpoint.uri` into an
    empty run directory). A checkpoint saved under a config this run directory has recorded passes: one kept
    in its history, or `vetted` - the config `check_resume` compared `cfg` with, before a change to it is
    recorded (after that, it is in the history). Returns a change still to be recorded (allowed by the
    flag), else None."""
    where = checkpoint_dir / "config.yaml"
    text = where.read_text()
    change = changes(text, cfg, str(where))
    if change is None or not change.forced:
        return None
    saved = _flat(text, str(where))
    recorded = [(old.read_text(), str(old)) for old in sorted((run_dir / HISTORY).glob("*.yaml"))]
    for old_text, old_where in ([(vetted, "the recorded config")] if vetted else []) + recorded:
        if all(is_mutable(k) for k in _diff(_flat(old_text, old_where), saved)):
            return None  # saved under a config whose change was accepted (and recorded, or about to be)
    if allow:
        return change
    raise _refusal(run_dir, change, f"checkpoint {checkpoint_dir.name}")


def record(run_dir: Path, change: ConfigChange, allowed_by_flag: bool) -> dict[str, Any]:
    """Keep the previous config as config_history/NNNN.yaml and append a line to changes.jsonl."""
    history = run_dir / HISTORY
    history.mkdir(parents=True, exist_ok=True)
    kept = history / f"{len(list(history.glob('*.yaml'))) + 1:04d}.yaml"
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "previous_config": f"{HISTORY}/{kept.name}",
        "forced": change.forced,
        "allowed_by_flag": allowed_by_flag and bool(change.forced),
        "changed": {k: {"old": old, "new": new} for k, (old, new) in change.changed.items()},
    }
    log = history / "changes.jsonl"
    lines = log.read_text() if log.is_file() else ""
    write_atomic(kept, change.previous_yaml)  # each file whole or not at all (a full disk, a crash)
    try:
        write_atomic(log, lines + json.dumps(entry, default=str) + "\n")
    except BaseException:
        kept.unlink(missing_ok=True)
        raise
    return entry


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / HISTORY / "changes.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
