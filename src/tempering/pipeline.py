"""The stages of a run: prepare -> SFT warm-up -> held-out eval -> RL -> held-out eval -> summary.

Each stage leaves a marker in the run directory, so `tempering train` on an interrupted run skips what is
done and resumes the RL loop from its newest valid checkpoint. A stage whose input changed is redone: the
held-out evaluation after RL names the checkpoint step it evaluated and is recomputed when RL has gone
further (more `train.steps`, or a run that `train.max_time_s` stopped early and that was continued).
Everything that can fail on bad input (config, task files, model path, a sandbox service that is down, a
config that differs from the one the run directory was made with) is checked before anything is written.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from tempering.agent.episodes import close_agents
from tempering.checkpoint import resolve_model
from tempering.config import RunConfig
from tempering.data import load_tasks
from tempering.data.difficulty import family_rates, pick_per_family
from tempering.envs import env_context
from tempering.errors import CheckpointError, ConfigError, DiskFullError
from tempering.eval.evaluate import evaluate
from tempering.inference.engine import SamplingParams, open_model
from tempering.loop import RLTrainer
from tempering.models.loading import compute_dtype, resolve_device
from tempering.models.registry import prepare as prepare_model
from tempering.roles import build_roles
from tempering.runtime import configure
from tempering.sandbox import Sandbox
from tempering.start import base_model_dir, sft_stage
from tempering.state import TrainState
from tempering.summary import print_summary, write_summary
from tempering.tracking import Tracker
from tempering.types import Task
from tempering.workspace import Workspace, builtin_tasks, make_sandbox, prepare, write_json

# ----------------------------------------------------------------------------------------- stages


def eval_key(ws: Workspace, model_dir: Path, step: int | None, tasks: list[Task]) -> dict[str, Any]:
    """What a held-out evaluation depends on: the model (its directory and, after RL, the checkpoint step),
    the tasks themselves (a digest of their content), and every setting that shapes the numbers -
    sampling, the environment (instruction, context, feedback, turns, chat format), the seed and the
    sandbox's limits. A stored result is reused only when its key is equal."""
    cfg = ws.cfg
    model = model_dir.resolve()
    run_dir = ws.run_dir.resolve()
    digest = hashlib.sha256("\n".join(t.model_dump_json() for t in tasks).encode()).hexdigest()
    s = cfg.sandbox
    return {
        "model": str(model.relative_to(run_dir)) if model.is_relative_to(run_dir) else str(model),
        "step": step,
        "heldout_tasks": len(tasks),
        "heldout_sha256": digest,
        "samples": cfg.eval.samples,
        "temperature": cfg.eval.temperature,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "env": cfg.env.model_dump(),
        "seed": cfg.run.seed,
        "sandbox_limits": [s.timeout_s, s.cpu_s, s.memory_mb, s.max_output_bytes],
        **(
            {"compute": "bfloat16"}
            if compute_dtype(cfg.model.compute, cfg.run.device) == torch.bfloat16
            else {}
        ),
    }


def heldout_eval(
    ws: Workspace,
    model_dir: Path,
    sandbox: Sandbox,
    name: str,
    step: int | None = None,
    tasks: list[Task] | None = None,
    sampled: bool = True,
) -> dict[str, Any]:
    """Sampled (T = eval.temperature, eval.samples per task; unless `sampled` is False) and greedy pass@1 on
    `tasks` (all held-out tasks by default).

    The result (RUN_DIR/<name>.json) records what it evaluated (`eval_key`: the model and, after RL, the
    checkpoint step); an existing one is reused only for the same key, so a run that went on training is
    evaluated again instead of reporting a model that no longer exists."""
    path = ws.run_dir / f"{name}.json"
    tasks = ws.heldout_tasks if tasks is None else tasks
    key = {**eval_key(ws, model_dir, step, tasks), **({} if sampled else {"sampled": False})}
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("evaluated") == key:
            return stored
        was = (stored.get("evaluated") or {}).get("model", "an unrecorded model")
        ws.log(f"{name}.json evaluated {was} with other settings or another model; evaluating {key['model']}")
    cfg = ws.cfg
    began = time.perf_counter()
    engine = config_engine(
        cfg, model_dir, SamplingParams(cfg.eval.temperature, 1.0, cfg.rollout.max_new_tokens)
    )
    kw = dict(max_context=cfg.env.max_context, chat=cfg.env.chat_format)
    ctx = env_context(cfg, sandbox)
    result: dict[str, Any] = {"evaluated": key}
    try:
        if sampled:
            result["sampled"] = evaluate(
                engine, tasks, ctx, samples=cfg.eval.samples, seed=cfg.run.seed + 7, **kw
            ).to_json()
        result["greedy"] = evaluate(engine, tasks, ctx, greedy=True, **kw).to_json()
    finally:
        close_agents(engine)  # a run of the user's agent: its proxy and server go with this engine
    result["wall_time_s"] = time.perf_counter() - began
    write_json(path, result)
    return result


def config_engine(cfg: RunConfig, model_dir: Path, sampling: SamplingParams):
    """An engine over `model_dir` as the config loads and runs models (dtype, device, compute)."""
    return open_model(
        model_dir, sampling, device=cfg.run.device, compute=cfg.model.compute, dtype=cfg.model.dtype
    )


def measure_pass_rates(cfg: RunConfig, per_family: int, samples: int, seed: int) -> dict[str, Any]:
    """The start model's pass rate per task family (`data/difficulty.py`) on `per_family` training tasks of
    each, sampled as RL samples (rollout temperature and length, the environment's instruction): what
    `tempering data pass-rates` writes and `data.pass_rates` reads."""
    if not (cfg.model.name or cfg.model.path):
        raise ConfigError(
            "data pass-rates: the config names no start model (model.name or model.path); "
            "the built-in tiny model exists only after the run's SFT"
        )
    d, ro = cfg.data, cfg.rollout
    train = load_tasks(d.train_file, d.columns) if d.train_file else builtin_tasks(cfg)[0]
    tasks = pick_per_family(train, per_family)
    model_dir = prepare_model(cfg.model.name) if cfg.model.name else resolve_model(cfg.model.path)
    cfg.run.device = resolve_device(cfg.run.device)
    configure(cfg.run.threads)
    engine = config_engine(cfg, model_dir, SamplingParams(ro.temperature, ro.top_p, ro.max_new_tokens))
    began = time.perf_counter()
    with make_sandbox(cfg) as sandbox:
        report = evaluate(
            engine,
            tasks,
            env_context(cfg, sandbox),
            samples=samples,
            max_context=cfg.env.max_context,
            seed=seed,
            chat=cfg.env.chat_format,
        )
    return {
        "model": cfg.model.name or str(model_dir),
        "samples": report.samples,
        "temperature": ro.temperature,
        "max_new_tokens": ro.max_new_tokens,
        "tasks": len(tasks),
        "pass@1": report.overall["pass@1"],
        "wall_time_s": round(time.perf_counter() - began, 1),
        "families": family_rates(tasks, report.per_task, report.samples),
        "domains": family_rates(tasks, report.per_task, report.samples, key=lambda t: t.domain),
    }


def benchmark_eval(
    ws: Workspace, name: str, model_dir: Path, sandbox: Sandbox, when: str, step: int | None = None
) -> dict[str, Any]:
    """Greedy pass@1 on a named task set of `eval.benchmarks` (RUN_DIR/<name>_<when>.json)."""
    result = heldout_eval(
        ws, model_dir, sandbox, f"{name}_{when}", step, tasks=ws.benchmarks[name], sampled=False
    )
    ws.log(f"{name} greedy pass@1 {when} RL: {result['greedy']['overall']['pass@1']:.1%}")
    return result


def rl_stage(ws: Workspace, start: Path, sandbox: Sandbox) -> tuple[Path, int]:
    """RL from the newest checkpoint (or `start`) to `train.steps` or `train.max_time_s`.
    -> (the final checkpoint's model directory, its step)"""
    cfg = ws.cfg
    state = TrainState.build_or_resume(
        cfg,
        ws.run_dir,
        ws.rl_tasks,
        start,
        resume=ws.resume,
        allow_config_change=ws.allow_config_change,
        log=ws.log,
    )
    last = state.step
    try:
        if state.step < cfg.train.steps:
            t = cfg.tracking
            tracker = Tracker(
                ws.run_dir,
                start_step=state.step,
                total_steps=cfg.train.steps,
                tensorboard=t.tensorboard,
                progress=t.progress,
                console=ws.console,
                wandb=t.wandb,
                mlflow=t.mlflow,
                project=t.project,
                config=cfg.model_dump(),
            )
            try:
                roles = build_roles(cfg, state, ws.heldout_tasks, sandbox, log=ws.log)
                last = RLTrainer(cfg, state, ws.heldout_tasks, roles, log=ws.log).run(tracker)
            finally:
                tracker.close()
    finally:
        state.saver.close()
    return final_checkpoint(state, cfg, last) / "model", last


def final_checkpoint(state: TrainState, cfg: RunConfig, step: int) -> Path:
    """The checkpoint of the last step run, which the evaluation after RL loads: when its save failed, it is
    written now, synchronously - except on a full disk (that does not free itself so soon), where the run
    stops with one line; the same command resumes from LATEST once there is room."""
    final, saver = state.saver.root / f"step_{step:06d}", state.saver
    if not final.is_dir() and not isinstance(saver.last_failure, DiskFullError):
        saver.asynchronous = False
        state.save(step, cfg.to_yaml())
    if not final.is_dir():
        what = "make room and run" if isinstance(saver.last_failure, DiskFullError) else "fix that and run"
        raise CheckpointError(
            f"{saver.errors[-1]}; the evaluation after RL needs this final checkpoint, and "
            f"{saver.kept()}: {what} the same command again"
        )
    return final


# ------------------------------------------------------------------------------------------- train


def train(
    cfg: RunConfig, console: Console | None = None, allow_config_change: bool = False
) -> dict[str, Any]:
    """The whole recipe; returns summary.json's content."""
    began = time.perf_counter()
    ws = prepare(cfg, console, allow_config_change, resume=True)
    ws.log(
        f"run directory: {ws.run_dir}  ({len(ws.sft_tasks)} SFT tasks, {len(ws.rl_tasks)} RL tasks, "
        f"{len(ws.heldout_tasks)} held-out)"
    )
    sandbox = make_sandbox(cfg)
    try:
        start = base_model_dir(ws, sandbox)
        start = sft_stage(ws, start, sandbox)
        before = heldout_eval(ws, start, sandbox, "eval_before")
        ws.log(
            f"held-out pass@1 before RL: sampled {before['sampled']['overall']['pass@1']:.1%}, "
            f"greedy {before['greedy']['overall']['pass@1']:.1%}"
        )
        benchmarks = {
            name: [benchmark_eval(ws, name, start, sandbox, "before")] for name in cfg.eval.benchmarks
        }
        final, last_step = rl_stage(ws, start, sandbox)
        gc.collect()  # the trainer's models and engine (reference cycles) go before the final model is loaded
        after = heldout_eval(ws, final, sandbox, "eval_after", step=last_step)
        for name, pair in benchmarks.items():
            pair.append(benchmark_eval(ws, name, final, sandbox, "after", step=last_step))
    finally:
        sandbox.close()
    summary = write_summary(
        ws,
        before,
        after,
        time.perf_counter() - began,
        benchmarks={name: tuple(pair) for name, pair in benchmarks.items()},
    )
    print_summary(ws.console, summary)
    return summary
