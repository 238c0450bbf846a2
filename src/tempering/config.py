"""Typed run configuration: YAML file + dotted `key.path=value` overrides -> `RunConfig`.

Every field carries a one-line doc (the docstring under it, in `config_sections.py`). Unknown keys and
wrong types are errors that name the key; an unknown key also lists the valid ones at that level.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError, ValidationInfo, model_validator

from tempering.config_algo import AlgoSection, RewardSection
from tempering.config_sections import (
    AgentSection,
    CheckpointSection,
    DataSection,
    DistributedSection,
    EnvSection,
    EvalSection,
    ModelSection,
    RolloutSection,
    RunSection,
    SandboxSection,
    Section,
    SFTSection,
    TrackingSection,
    TrainSection,
)
from tempering.errors import ConfigError

CHECKS: list[Callable[[RunConfig], None]] = []
"""Whole-config checks run when a RunConfig is validated; each raises ValueError naming the key."""


class RunConfig(Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    sft: SFTSection = SFTSection()
    rollout: RolloutSection = RolloutSection()
    env: EnvSection = EnvSection()
    agent: AgentSection = AgentSection()
    algo: AlgoSection = AlgoSection()
    reward: RewardSection = RewardSection()
    sandbox: SandboxSection = SandboxSection()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    tracking: TrackingSection = TrackingSection()
    distributed: DistributedSection = DistributedSection()

    @model_validator(mode="after")
    def _check_names(self, info: ValidationInfo) -> RunConfig:
        """Registry names, user code, reward params and cross-field rules are checked here, so a mistake fails
        at load time, before the run directory is touched. The checks need the registries, which live above
        this module: `tempering.config_checks` registers them in `CHECKS` when `tempering` is imported, so
        this module stays a leaf. `load_config(..., checks=False)` skips them (nothing named is imported)."""
        if info.context and not info.context.get("checks", True):
            return self
        for check in CHECKS:
            check(self)
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


# ----------------------------------------------------------------------------------------- loading


def _valid_keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _section_at(path: list[str]) -> type[BaseModel] | None:
    """The Section class reached by following `path` from RunConfig, or None past a non-Section field."""
    model: type[BaseModel] = RunConfig
    for key in path:
        field = model.model_fields.get(key)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _check_key(path: list[str]) -> None:
    """Raise ConfigError if the dotted key does not exist (dict-valued fields accept any sub-key)."""
    model: type[BaseModel] = RunConfig
    for i, key in enumerate(path):
        if key not in model.model_fields:
            where = ".".join(path[:i]) or "the top level"
            raise ConfigError(
                f"unknown config key '{'.'.join(path[: i + 1])}'; valid keys under {where}: {_valid_keys(model)}"
            )
        annotation = model.model_fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        elif i < len(path) - 1 and not _is_dict(annotation):
            raise ConfigError(f"config key '{'.'.join(path[: i + 1])}' is a value, not a section")
        else:
            return


def _is_dict(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is dict


def parse_override(text: str) -> tuple[list[str], Any]:
    """`algo.lr=1e-4` -> (['algo', 'lr'], 0.0001). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key.path=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e.problem})") from None
    return path, value


def _set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        node = tree.get(key)
        if not isinstance(node, dict):
            node = tree[key] = {}
        tree = node
    tree[path[-1]] = value


def _walk_keys(tree: dict[str, Any], prefix: list[str]) -> None:
    """Check every key of a YAML tree, so a typo in a file is reported like a typo in an override."""
    for key, value in tree.items():
        path = [*prefix, str(key)]
        _check_key(path)
        if isinstance(value, dict) and _section_at(path) is not None:
            _walk_keys(value, path)


def _format_validation(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        key = ".".join(str(p) for p in e["loc"])
        if not key:  # a model-level check (e.g. _known_names) already names its key
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        elif e["type"] == "extra_forbidden":
            parent = _section_at([str(p) for p in e["loc"][:-1]])
            valid = f"; valid keys: {_valid_keys(parent)}" if parent else ""
            lines.append(f"unknown config key '{key}'{valid}")
        else:
            lines.append(f"config key '{key}': {e['msg']} (got {e['input']!r})")
    return "; ".join(lines)


def build_config(
    tree: dict[str, Any] | None = None, overrides: Sequence[str] = (), *, checks: bool = True
) -> RunConfig:
    """Validate a nested dict plus dotted overrides into a RunConfig (`checks`: see `load_config`)."""
    tree = dict(tree or {})
    _walk_keys(tree, [])
    for text in overrides:
        path, value = parse_override(text)
        _check_key(path)
        _set(tree, path, value)
    try:
        return RunConfig.model_validate(tree, context={"checks": checks})
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, checks: bool = True) -> RunConfig:
    """Read a YAML config (None = all defaults) and apply `key.path=value` overrides. A file may start
    from another with `base: other.yaml` (relative to itself); its own keys override the base's.
    `checks=False` validates keys and types only: no user code it names is imported (a model's run config
    read for its settings, `agent.commands.run_settings`)."""
    return build_config(_read_tree(Path(path)) if path is not None else {}, overrides, checks=checks)


def _read_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config file '{path}' names itself as a base (through 'base:')")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, not {type(tree).__name__}")
    base = tree.pop("base", None)
    if base is None:
        return tree
    return _merge(_read_tree(path.parent / str(base), (*seen, path.resolve())), tree)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out
