"""A run's workspace: every input checked, then the run directory and its resolved config written.

`prepare` is where bad input fails - the config (and, on an existing run directory, whether it may differ
from the recorded one), the model path, task files, a sandbox service that is down, the sandbox's
interpreter, the checkpoint mirror's scheme, a checkpoint to resume from that was saved under a refused
config - with one line naming the problem, before anything is written. Then the run directory,
`config.yaml` and the task splits (`data/`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from tempering import config_history
from tempering.checkpoint import resolve_model
from tempering.config import RunConfig
from tempering.data import (
    MixtureSampler,
    generate_tasks,
    hold_out_functions,
    load_tasks,
    save_tasks,
    split_stages,
)
from tempering.data.difficulty import in_range, kept, load_pass_rates
from tempering.envs import env_context, environment_class
from tempering.errors import ConfigError, SandboxError
from tempering.files import write_atomic
from tempering.models.loading import check_model_dir, compute_dtype, resolve_device
from tempering.runtime import configure
from tempering.sandbox import RemoteSandbox, Sandbox, SandboxLimits, limits_of, open_sandbox
from tempering.state import Resume, find_resume
from tempering.training.sft import Transcript
from tempering.training.transcripts import sft_transcripts
from tempering.types import Task


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=1))


@dataclass
class Workspace:
    cfg: RunConfig
    run_dir: Path
    train_tasks: list[Task]
    heldout_tasks: list[Task]
    sft_tasks: list[Task]
    rl_tasks: list[Task]
    console: Console
    benchmarks: dict[str, list[Task]]
    """`eval.benchmarks`' task sets, evaluated before and after RL."""
    allow_config_change: bool = False
    """`--allow-config-change`: a resumed run may change keys outside `config_history.MUTABLE`."""
    resume: Resume | None = None
    """Where RL resumes, found by `prepare(..., resume=True)` before it wrote anything."""
    sft_val_tasks: list[Task] = field(default_factory=list)
    """SFT's validation tasks (`sft.stop_at`): training functions held out from SFT's examples."""
    _transcripts: list[tuple[Task, Transcript]] | None = None

    def log(self, message: str) -> None:
        self.console.print(message)

    def transcripts(self, sandbox: Sandbox) -> list[tuple[Task, Transcript]]:
        """SFT transcripts of the SFT tasks (built once; deterministic in the data seed)."""
        if self._transcripts is None:
            # Reference transcripts may need more turns than RL allows (retries of a flaky call).
            ctx = env_context(self.cfg, sandbox)
            ctx.max_turns = max(ctx.max_turns, 8)
            self._transcripts = sft_transcripts(
                self.sft_tasks, ctx, repair_fraction=self.cfg.sft.repair_fraction, seed=self.cfg.data.seed
            )
        return self._transcripts


def prepare(
    cfg: RunConfig, console: Console | None = None, allow_config_change: bool = False, resume: bool = False
) -> Workspace:
    """Validate the inputs, then create the run directory and write the resolved config.

    On an existing run directory, a config that differs from the recorded one outside
    `config_history.MUTABLE` is refused unless `allow_config_change`; every change is recorded. `resume`
    (`train`): find the checkpoint RL will resume from first (`state.find_resume`), so a checkpoint that
    cannot be resumed from fails before config.yaml or the history is rewritten."""
    console = console or Console(stderr=True)
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir '{run_dir}' exists and is not a directory")
    # The device first: the recorded config holds the resolved one (`auto` would read as a change every time).
    cfg.run.device = resolve_device(cfg.run.device)
    change = config_history.check_resume(run_dir, cfg, allow_config_change)
    if cfg.model.path:  # the start model this run recorded when it began, else what the path names now
        check_model_dir(recorded_start(run_dir, cfg.model.path) or resolve_model(cfg.model.path))
    compute_dtype(cfg.model.compute, cfg.run.device)  # bfloat16 where it is slower: refused now
    check_sandbox_url(cfg)
    _check_outside_inputs(cfg)
    train, heldout = _read_tasks(cfg, run_dir)
    benchmarks = {name: load_tasks(name) for name in cfg.eval.benchmarks}  # a missing package fails now
    _check_disjoint(train, heldout)
    _check_task_envs(cfg, [*train, *heldout, *(t for tasks in benchmarks.values() for t in tasks)])
    try:
        sft, rl = split_stages(train, cfg.data.sft_fraction, cfg.data.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sft_val: list[Task] = []
    if cfg.sft.stop_at is not None and cfg.sft.steps > 0:
        try:
            sft, sft_val = hold_out_functions(sft, cfg.eval.val_tasks, cfg.data.seed)
        except ValueError as e:
            raise ConfigError(f"sft.stop_at: {e}") from None
    if cfg.data.mixture:
        try:
            MixtureSampler(rl, cfg.data.mixture, cfg.run.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    configure(cfg.run.threads)
    found = None
    if resume:  # the checkpoint RL resumes from is found (and its config checked) before anything is written
        found = find_resume(
            cfg,
            run_dir,
            allow_config_change=allow_config_change,
            log=console.print,
            vetted=change.previous_yaml if change is not None else None,
        )

    run_dir.mkdir(parents=True, exist_ok=True)
    if change is not None:
        entry = config_history.record(run_dir, change, allow_config_change)
        how = "accepted with --allow-config-change" if change.forced else "allowed on resume"
        console.print(
            f"config changed ({how}): {change.describe()}; previous config kept in "
            f"{run_dir / entry['previous_config']}"
        )
    if found is not None:
        found.record(run_dir, allow_config_change, console.print)
    write_atomic(run_dir / "config.yaml", cfg.to_yaml())
    data_dir = run_dir / "data"
    if not (data_dir / "heldout.jsonl").exists():
        save_tasks(train, data_dir / "train.jsonl")
        save_tasks(heldout, data_dir / "heldout.jsonl")
    return Workspace(
        cfg,
        run_dir,
        train,
        heldout,
        sft,
        rl,
        console,
        benchmarks,
        allow_config_change=allow_config_change,
        resume=found,
        sft_val_tasks=sft_val,
    )


def _read_tasks(cfg: RunConfig, run_dir: Path) -> tuple[list[Task], list[Task]]:
    """The run's training and held-out tasks: the configured files, else the ones the run generated
    before, else the built-in generator's; in the pass-rate range when `data.pass_rates` is set."""
    train = load_tasks(cfg.data.train_file, cfg.data.columns) if cfg.data.train_file else None
    heldout = load_tasks(cfg.data.heldout_file, cfg.data.columns) if cfg.data.heldout_file else None
    run_dir_data = run_dir / "data" / "heldout.jsonl"
    if (train is None or heldout is None) and run_dir_data.is_file() and cfg.data.generators != ["code"]:
        # Generated once (reasoning-gym takes a while): a resumed run reads its own task files.
        train = train if train is not None else load_tasks(run_dir / "data" / "train.jsonl")
        heldout = heldout if heldout is not None else load_tasks(run_dir_data)
    rates = load_pass_rates(cfg.data.pass_rates, cfg.data.pass_key) if cfg.data.pass_rates else None
    if train is None or heldout is None:
        gen_train, gen_heldout = builtin_tasks(cfg, rates)
        train = train if train is not None else gen_train
        heldout = heldout if heldout is not None else gen_heldout
    if rates is not None:
        train, heldout = _in_pass_range(cfg, rates, train, heldout)
    return train, heldout


START_RECORD = "start.json"


def recorded_start(run_dir: Path, model_path: str) -> Path | None:
    """The start model a run resolved `model_path` to when it began (RUN_DIR/start.json), if it did (and
    `model.path` is still the one it resolved)."""
    path = run_dir / START_RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    return Path(record["resolved"]) if record.get("model.path") == model_path else None


def builtin_tasks(cfg: RunConfig, rates: dict[str, float] | None = None) -> tuple[list[Task], list[Task]]:
    """(train, held-out) from the generators named by `data.generator`; given the measured pass `rates`, the
    code generator draws only from templates in `data.pass_range` (so `data.num_train` / `num_heldout` are
    what a run gets)."""
    names = cfg.data.generators
    parts = [_generated(cfg, name, rates) for name in names]
    if len(parts) == 1:
        return parts[0]
    owner: dict[str, str] = {}
    train: list[Task] = []
    heldout: list[Task] = []
    for name, (tr, he) in zip(names, parts):
        for domain in sorted({t.domain for t in tr + he}):
            if owner.setdefault(domain, name) != name:
                raise ConfigError(
                    f"data.generator: {owner[domain]} and {name} both make tasks of domain '{domain}'; "
                    "join generators whose domains differ"
                )
        train += [t.model_copy(update={"id": f"{name}:{t.id}"}) for t in tr]
        heldout += [t.model_copy(update={"id": f"{name}:{t.id}"}) for t in he]
    return train, heldout


def _generated(
    cfg: RunConfig, generator: str, rates: dict[str, float] | None
) -> tuple[list[Task], list[Task]]:
    """One generator's (train, held-out)."""
    d = cfg.data
    try:
        if generator == "code":
            templates = _templates_in_range(cfg, rates) if rates is not None else d.templates
            return generate_tasks(
                d.num_train,
                d.num_heldout,
                d.seed,
                d.domains,
                templates=templates,
                heldout_templates=d.heldout_templates,
                describe=d.describe,
            )
        if generator == "tools":
            from tempering.envs.tool_tasks import generate_tool_tasks

            return generate_tool_tasks(d.num_train, d.num_heldout, d.seed)
        if generator == "leetcode":
            from tempering.data.leetcode import leetcode_tasks

            return leetcode_tasks(d.num_train, d.num_heldout, d.seed, d.difficulties)
        if generator == "answer":
            from tempering.envs.answer import generate_answer_tasks

            return generate_answer_tasks(d.num_train, d.num_heldout, d.seed, d.domains)
        from tempering.envs.gym import gym_datasets, gym_tasks

        names = d.gym_datasets or gym_datasets()
        return gym_tasks(
            names,
            max(1, d.num_train // len(names)),
            d.gym_heldout_per_domain,
            d.seed,
            config=d.gym_config,
            max_prompt_chars=d.gym_max_prompt_chars,
        )
    except (ValueError, ImportError) as e:
        raise ConfigError(f"data ({generator} tasks): {e}") from None


def _templates_in_range(cfg: RunConfig, rates: dict[str, float]) -> list[str]:
    """`data.templates` (all by default) less those whose measured pass rate is outside `data.pass_range`."""
    from tempering.data.generators import TEMPLATES

    low, high = cfg.data.pass_range
    names = [n for n in cfg.data.templates or [t.name for t in TEMPLATES] if kept(n, rates, low, high)]
    if not names:
        raise ConfigError(_nothing_in_range(cfg, rates, "training"))
    return names


def _in_pass_range(
    cfg: RunConfig, rates: dict[str, float], train: list[Task], heldout: list[Task]
) -> tuple[list[Task], list[Task]]:
    """Training and held-out tasks whose family's measured pass rate is within `data.pass_range` (task
    files; generated tasks were drawn from the templates in range already)."""
    low, high = cfg.data.pass_range
    kept_tasks = in_range(train, rates, low, high), in_range(heldout, rates, low, high)
    for name, tasks in zip(("training", "held-out"), kept_tasks):
        if not tasks:
            raise ConfigError(_nothing_in_range(cfg, rates, name))
    return kept_tasks


def _nothing_in_range(cfg: RunConfig, rates: dict[str, float], split: str) -> str:
    low, high = cfg.data.pass_range
    return (
        f"data.pass_range: [{low}, {high}] leaves no {split} task "
        f"({sum(low <= r <= high for r in rates.values())} of {len(rates)} families in range)"
    )


def _check_disjoint(train: list[Task], heldout: list[Task]) -> None:
    overlap = {t.prompt for t in train} & {t.prompt for t in heldout}
    if overlap:
        raise ConfigError(f"{len(overlap)} held-out task prompt(s) also appear among the training tasks")


def _check_task_envs(cfg: RunConfig, tasks: list[Task]) -> None:
    """Every task's `env` is a built-in environment or one of `env.plugins` (checked when the config loaded),
    so a misspelt name fails now, not in the first rollout."""
    for name in sorted({t.env for t in tasks}):
        task = next(t for t in tasks if t.env == name)
        if ":" in name and name not in cfg.env.plugins:
            raise ConfigError(
                f"task '{task.id}': env '{name}' is not listed in env.plugins (an environment "
                "of your own is named there, so it is checked when the config loads)"
            )
        try:
            environment_class(name)
        except ConfigError as e:
            raise ConfigError(f"task '{task.id}': {e}") from None


def check_sandbox_url(cfg: RunConfig, timeout_s: float = 5.0) -> None:
    """A `sandbox.url` whose /health does not answer within a few seconds fails now, before anything is
    written (make_sandbox asks again, with the client's full retries, when the sandbox is opened)."""
    if not cfg.sandbox.url:
        return
    probe = RemoteSandbox(cfg.sandbox.url, timeout_s=timeout_s, retries=1, backoff_s=0.2)
    try:
        probe.health()
    except SandboxError as e:
        raise ConfigError(f"sandbox.url: {' '.join(str(e).split())}") from None
    except ValueError:  # a 200 that is not JSON: some other server
        raise ConfigError(
            f"sandbox.url: {cfg.sandbox.url}/health did not answer as a tempering sandbox service "
            "(`tempering sandbox serve`)"
        ) from None
    finally:
        probe.close()


def _check_outside_inputs(cfg: RunConfig) -> None:
    """Names of things outside the config that are otherwise first used after SFT: the interpreter that
    runs programs, the checkpoint store's URL scheme (no network: the store is only parsed)."""
    python = cfg.sandbox.python
    if python and not cfg.sandbox.url and not shutil.which(python):
        raise ConfigError(f"sandbox.python: '{python}' is not an executable (a path, or a name on PATH)")
    if cfg.checkpoint.uri:
        from tempering.checkpoint import RemoteStore

        RemoteStore(
            cfg.checkpoint.uri, cfg.checkpoint.storage
        )  # an unknown scheme or missing driver fails here


def sandbox_limits(cfg: RunConfig) -> SandboxLimits:
    return limits_of(cfg.sandbox)


def make_sandbox(cfg: RunConfig) -> Sandbox:
    """The run's sandbox (`sandbox.open_sandbox` of its `sandbox` section)."""
    return open_sandbox(cfg.sandbox)
