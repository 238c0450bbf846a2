"""The stages of a run: prepare -> SFT warm-up -> held-out eval -> RL -> held-out eval -> summary.

Each stage leaves a marker in the run directory, so `tempering train` on an interrupted run skips what is
done and resumes the RL loop from its newest valid checkpoint. A stage whose input changed is redone: the
held-out evaluation after RL names the checkpoint step it evaluated and is recomputed when RL has gone
further (more `train.steps`, or a run that `train.max_time_s` stopped early and that was continued).
Everything that can fail on bad input (config, task files, model path, a sandbox service that is down, a
config that differs from the one the run directory was made with) is checked before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from tempering import config_history
from tempering.config import RunConfig
from tempering.data import MixtureSampler, generate_tasks, load_tasks, save_tasks, split_stages
from tempering.envs.tools import tool_declarations
from tempering.errors import ConfigError, SandboxError
from tempering.eval.evaluate import EvalReport, evaluate
from tempering.loop import RLTrainer, env_context, uses_critic
from tempering.models.loading import (
    build_tiny_model,
    check_model_dir,
    load_model,
    load_tokenizer,
    num_parameters,
    resolve_device,
    save_model,
)
from tempering.models.tokenizer import train_tokenizer
from tempering.rollout.chat import chat_format
from tempering.rollout.engine import LocalEngine, SamplingParams
from tempering.sandbox import LocalSandbox, RemoteSandbox, Sandbox, SandboxLimits
from tempering.state import TrainState
from tempering.tracking import Tracker, read_metrics
from tempering.tracking.plot import plot_run
from tempering.training.sft import Transcript, encode_transcript, run_sft
from tempering.training.transcripts import sft_transcripts, transcript_text
from tempering.types import Task


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@dataclass
class Workspace:
    cfg: RunConfig
    run_dir: Path
    train_tasks: list[Task]
    heldout_tasks: list[Task]
    sft_tasks: list[Task]
    rl_tasks: list[Task]
    console: Console
    allow_config_change: bool = False
    """`--allow-config-change`: a resumed run may change keys outside `config_history.MUTABLE`."""
    _transcripts: list[tuple[Task, Transcript]] | None = None

    def log(self, message: str) -> None:
        self.console.print(message)

    def transcripts(self, sandbox: Sandbox) -> list[tuple[Task, Transcript]]:
        """SFT transcripts of the SFT tasks (built once; deterministic in the data seed)."""
        if self._transcripts is None:
            # Reference transcripts may need more turns than RL allows (retries of a flaky call).
            ctx = env_context(self.cfg, sandbox)
            ctx.max_turns = max(ctx.max_turns, 8)
            self._transcripts = sft_transcripts(self.sft_tasks, ctx, repair_fraction=self.cfg.sft.repair_fraction,
                                                seed=self.cfg.data.seed)
        return self._transcripts


def prepare(cfg: RunConfig, console: Console | None = None, allow_config_change: bool = False) -> Workspace:
    """Validate the inputs, then create the run directory and write the resolved config.

    On an existing run directory, a config that differs from the recorded one outside
    `config_history.MUTABLE` is refused unless `allow_config_change`; every change is recorded."""
    console = console or Console(stderr=True)
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir '{run_dir}' exists and is not a directory")
    change = config_history.check_resume(run_dir, cfg, allow_config_change)
    if cfg.model.path:
        check_model_dir(cfg.model.path)
    cfg.run.device = resolve_device(cfg.run.device)
    check_sandbox_url(cfg)
    _check_outside_inputs(cfg)
    train = load_tasks(cfg.data.train_file) if cfg.data.train_file else None
    heldout = load_tasks(cfg.data.heldout_file) if cfg.data.heldout_file else None
    run_dir_data = run_dir / "data" / "heldout.jsonl"
    if (train is None or heldout is None) and run_dir_data.is_file() and cfg.data.generator != "code":
        # Generated once (reasoning-gym takes a while): a resumed run reads its own task files.
        train = train if train is not None else load_tasks(run_dir / "data" / "train.jsonl")
        heldout = heldout if heldout is not None else load_tasks(run_dir_data)
    if train is None or heldout is None:
        gen_train, gen_heldout = builtin_tasks(cfg)
        train = train if train is not None else gen_train
        heldout = heldout if heldout is not None else gen_heldout
    _check_disjoint(train, heldout)
    try:
        sft, rl = split_stages(train, cfg.data.sft_fraction, cfg.data.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.data.mixture:
        try:
            MixtureSampler(rl, cfg.data.mixture, cfg.run.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    torch.set_num_threads(cfg.run.threads)

    run_dir.mkdir(parents=True, exist_ok=True)
    if change is not None:
        entry = config_history.record(run_dir, change, allow_config_change)
        how = "accepted with --allow-config-change" if change.forced else "allowed on resume"
        console.print(f"config changed ({how}): {change.describe()}; previous config kept in "
                      f"{run_dir / entry['previous_config']}")
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    data_dir = run_dir / "data"
    if not (data_dir / "heldout.jsonl").exists():
        save_tasks(train, data_dir / "train.jsonl")
        save_tasks(heldout, data_dir / "heldout.jsonl")
    return Workspace(cfg, run_dir, train, heldout, sft, rl, console, allow_config_change=allow_config_change)


def builtin_tasks(cfg: RunConfig) -> tuple[list[Task], list[Task]]:
    """(train, held-out) from the generator named by `data.generator`."""
    d = cfg.data
    try:
        if d.generator == "code":
            return generate_tasks(d.num_train, d.num_heldout, d.seed, d.domains)
        if d.generator == "tools":
            from tempering.envs.tool_tasks import generate_tool_tasks

            return generate_tool_tasks(d.num_train, d.num_heldout, d.seed)
        if d.generator == "answer":
            from tempering.envs.answer import generate_answer_tasks

            return generate_answer_tasks(d.num_train, d.num_heldout, d.seed, d.domains)
        from tempering.envs.gym import gym_datasets, gym_tasks

        names = d.gym_datasets or gym_datasets()
        return gym_tasks(names, max(1, d.num_train // len(names)), d.gym_heldout_per_domain, d.seed,
                         config=d.gym_config, max_prompt_chars=d.gym_max_prompt_chars)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"data ({d.generator} tasks): {e}") from None


def _check_disjoint(train: list[Task], heldout: list[Task]) -> None:
    overlap = {t.prompt for t in train} & {t.prompt for t in heldout}
    if overlap:
        raise ConfigError(f"{len(overlap)} held-out task prompt(s) also appear among the training tasks")


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
        raise ConfigError(f"sandbox.url: {cfg.sandbox.url}/health did not answer as a tempering sandbox service "
                          "(`tempering sandbox serve`)") from None
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

        RemoteStore(cfg.checkpoint.uri, cfg.checkpoint.storage)  # an unknown scheme or missing driver fails here


def make_sandbox(cfg: RunConfig) -> Sandbox:
    """The local worker pool, or the service at `sandbox.url` (checked before training starts)."""
    s = cfg.sandbox
    limits = SandboxLimits(timeout_s=s.timeout_s, cpu_s=s.cpu_s, memory_mb=s.memory_mb,
                           max_output_bytes=s.max_output_bytes)
    if s.url:
        remote = RemoteSandbox(s.url, limits)
        remote.health()  # a service that is down is reported now, not after the model is loaded
        return remote
    return LocalSandbox(limits, workers=s.workers, python=s.python, isolation=s.isolation,
                        scratch_mb=s.scratch_mb)


# ----------------------------------------------------------------------------------------- stages


def base_model_dir(ws: Workspace, sandbox: Sandbox | None = None) -> Path:
    """The starting model: `model.path`, or the tiny default built (once) into RUN_DIR/base."""
    cfg = ws.cfg
    if cfg.model.path:
        return Path(cfg.model.path)
    base = ws.run_dir / "base"
    if not (base / "config.json").is_file():
        # Prompts of every training task, solutions only of SFT tasks: RL never sees a reference solution.
        sft_ids = {t.id for t in ws.sft_tasks}
        texts = [transcript_text(t, tr) for t, tr in ws.transcripts(sandbox)]
        texts += [t.prompt for t in ws.rl_tasks if t.id not in sft_ids]
        tokenizer = train_tokenizer(texts, vocab_size=cfg.model.vocab_size)
        m = cfg.model
        model = build_tiny_model(tokenizer, hidden_size=m.hidden_size, num_layers=m.num_layers,
                                 num_heads=m.num_heads, intermediate_size=m.intermediate_size,
                                 max_length=m.max_length, seed=cfg.run.seed)
        tmp = ws.run_dir / "base.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tokenizer, tmp)
        shutil.rmtree(base, ignore_errors=True)
        os.replace(tmp, base)
        ws.log(f"built tiny model: {num_parameters(model) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")
    return base


def sft_stage(ws: Workspace, start: Path, sandbox: Sandbox | None = None) -> Path:
    """Supervised warm-up into RUN_DIR/sft/model (skipped when done, or when sft.steps is 0)."""
    cfg = ws.cfg
    if cfg.sft.steps <= 0:
        return start
    out = ws.run_dir / "sft"
    done = out / "DONE.json"
    if done.is_file():
        return out / "model"
    out.mkdir(exist_ok=True)
    model = load_model(start, dtype=cfg.model.dtype, device=cfg.run.device)
    tokenizer = load_tokenizer(start)
    s = cfg.sft
    began = time.perf_counter()
    fmt = chat_format(tokenizer, cfg.env.chat_format)
    examples = [encode_transcript(fmt, t.prompt, tr, tool_declarations(t) if t.env == "tool" else None)
                for t, tr in ws.transcripts(sandbox)]
    with (out / "metrics.jsonl").open("w") as f:
        def on_step(step: int, row: dict[str, float]) -> None:
            f.write(json.dumps(row) + "\n")
            if step % max(1, s.steps // 10) == 0 or step == s.steps:
                ws.log(f"sft step {step}/{s.steps}  loss {row['sft/loss']:.3f}")

        run_sft(model, tokenizer, ws.sft_tasks, steps=s.steps, batch_size=s.batch_size, lr=s.lr,
                warmup_steps=s.warmup_steps, schedule=s.schedule, weight_decay=s.weight_decay,
                seed=cfg.run.seed, on_step=on_step, examples=examples)
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    shutil.rmtree(out / "model", ignore_errors=True)
    os.replace(tmp, out / "model")
    _write_json(done, {"steps": s.steps, "wall_time_s": time.perf_counter() - began})
    return out / "model"


def eval_key(ws: Workspace, model_dir: Path, step: int | None) -> dict[str, Any]:
    """What a held-out evaluation depends on: the model (its directory and, after RL, the checkpoint step)
    and the settings that shape the numbers. A stored result is reused only when its key is equal."""
    cfg = ws.cfg
    model = model_dir.resolve()
    run_dir = ws.run_dir.resolve()
    return {"model": str(model.relative_to(run_dir)) if model.is_relative_to(run_dir) else str(model),
            "step": step, "heldout_tasks": len(ws.heldout_tasks), "samples": cfg.eval.samples,
            "temperature": cfg.eval.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
            "max_turns": cfg.env.max_turns}


def heldout_eval(ws: Workspace, model_dir: Path, sandbox: Sandbox, name: str,
                 step: int | None = None) -> dict[str, Any]:
    """Sampled (T = eval.temperature, eval.samples per task) and greedy pass@1 on all held-out tasks.

    The result (RUN_DIR/<name>.json) records what it evaluated (`eval_key`: the model and, after RL, the
    checkpoint step); an existing one is reused only for the same key, so a run that went on training is
    evaluated again instead of reporting a model that no longer exists."""
    path = ws.run_dir / f"{name}.json"
    key = eval_key(ws, model_dir, step)
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("evaluated") == key:
            return stored
        was = (stored.get("evaluated") or {}).get("model", "an unrecorded model")
        ws.log(f"{name}.json evaluated {was} with other settings or another model; evaluating {key['model']}")
    cfg = ws.cfg
    began = time.perf_counter()
    model = load_model(model_dir, dtype=cfg.model.dtype, device=cfg.run.device)
    tokenizer = load_tokenizer(model_dir)
    engine = LocalEngine(model, tokenizer, SamplingParams(cfg.eval.temperature, 1.0, cfg.rollout.max_new_tokens))
    kw = dict(max_context=cfg.env.max_context, chat=cfg.env.chat_format)
    ctx = env_context(cfg, sandbox)
    sampled = evaluate(engine, ws.heldout_tasks, ctx, samples=cfg.eval.samples, seed=cfg.run.seed + 7, **kw)
    greedy = evaluate(engine, ws.heldout_tasks, ctx, greedy=True, **kw)
    result = {"evaluated": key, "sampled": _strip(sampled), "greedy": _strip(greedy),
              "wall_time_s": time.perf_counter() - began}
    _write_json(path, result)
    return result


def _strip(report: EvalReport) -> dict[str, Any]:
    data = report.to_json()
    data.pop("per_task")
    return data


def rl_stage(ws: Workspace, start: Path, sandbox: Sandbox) -> tuple[Path, int]:
    """RL from the newest checkpoint (or `start`) to `train.steps` or `train.max_time_s`.
    -> (the final checkpoint's model directory, its step)"""
    cfg = ws.cfg
    state = TrainState.build_or_resume(cfg, ws.run_dir, ws.rl_tasks, start, needs_critic=uses_critic(cfg),
                                       allow_config_change=ws.allow_config_change, log=ws.log)
    last = state.step
    try:
        if state.step < cfg.train.steps:
            tracker = Tracker(ws.run_dir, start_step=state.step, total_steps=cfg.train.steps,
                              tensorboard=cfg.tracking.tensorboard, progress=cfg.tracking.progress,
                              console=ws.console)
            try:
                last = RLTrainer(cfg, state, ws.heldout_tasks, sandbox, log=ws.log).run(tracker)
            finally:
                tracker.close()
    finally:
        state.saver.close()
    final = state.saver.root / f"step_{last:06d}"
    if not final.is_dir():  # e.g. the last save failed: write it now, synchronously
        state.saver.asynchronous = False
        state.save(last, cfg.to_yaml())
    return final / "model", last


# ------------------------------------------------------------------------------------------- train


def train(cfg: RunConfig, console: Console | None = None, allow_config_change: bool = False) -> dict[str, Any]:
    """The whole recipe; returns summary.json's content."""
    began = time.perf_counter()
    ws = prepare(cfg, console, allow_config_change)
    ws.log(f"run directory: {ws.run_dir}  ({len(ws.sft_tasks)} SFT tasks, {len(ws.rl_tasks)} RL tasks, "
           f"{len(ws.heldout_tasks)} held-out)")
    sandbox = make_sandbox(cfg)
    try:
        start = base_model_dir(ws, sandbox)
        start = sft_stage(ws, start, sandbox)
        before = heldout_eval(ws, start, sandbox, "eval_before")
        ws.log(f"held-out pass@1 before RL: sampled {before['sampled']['overall']['pass@1']:.1%}, "
               f"greedy {before['greedy']['overall']['pass@1']:.1%}")
        final, last_step = rl_stage(ws, start, sandbox)
        after = heldout_eval(ws, final, sandbox, "eval_after", step=last_step)
    finally:
        sandbox.close()
    summary = write_summary(ws, before, after, time.perf_counter() - began)
    print_summary(ws.console, summary)
    return summary


def write_summary(ws: Workspace, before: dict, after: dict, wall_time_s: float) -> dict[str, Any]:
    rows = read_metrics(ws.run_dir / "metrics.jsonl")
    sft_done = ws.run_dir / "sft" / "DONE.json"
    rl_s = sum((r.get("timing_s/step") or 0) + (r.get("timing_s/checkpoint") or 0) for r in rows)
    summary = {
        "heldout_pass@1_before": before["sampled"]["overall"]["pass@1"],
        "heldout_pass@1_after": after["sampled"]["overall"]["pass@1"],
        "heldout_greedy_pass@1_before": before["greedy"]["overall"]["pass@1"],
        "heldout_greedy_pass@1_after": after["greedy"]["overall"]["pass@1"],
        "heldout_tasks": before["sampled"]["num_tasks"],
        **({"heldout_first_turn_pass@1_before": before["sampled"]["overall"]["first_turn_pass@1"],
            "heldout_first_turn_pass@1_after": after["sampled"]["overall"]["first_turn_pass@1"]}
           if "first_turn_pass@1" in before["sampled"]["overall"] else {}),
        "heldout_samples_per_task": before["sampled"]["samples"],
        "temperature": before["sampled"]["temperature"],
        "per_domain_before": {d: v["pass@1"] for d, v in before["sampled"]["per_domain"].items()},
        "per_domain_after": {d: v["pass@1"] for d, v in after["sampled"]["per_domain"].items()},
        "rl_steps": len(rows),
        "rl_step_evaluated": after.get("evaluated", {}).get("step"),
        "rl_steps_planned": ws.cfg.train.steps,
        "wall_time_s": wall_time_s,
        "wall_time_split_s": {
            "sft": json.loads(sft_done.read_text())["wall_time_s"] if sft_done.is_file() else 0.0,
            "eval_before": before["wall_time_s"],
            "rl": rl_s,
            "eval_after": after["wall_time_s"],
        },
    }
    history = config_history.read_history(ws.run_dir)
    if history:
        summary["config_changes"] = history
    _write_json(ws.run_dir / "summary.json", summary)
    val_before = {"val/pass@1": summary["heldout_pass@1_before"],
                  "val/greedy_pass@1": summary["heldout_greedy_pass@1_before"]}
    val_after = {"val/pass@1": summary["heldout_pass@1_after"],
                 "val/greedy_pass@1": summary["heldout_greedy_pass@1_after"]}
    plot_run(rows, ws.run_dir / "plot.png", before=val_before, after=val_after)
    return summary


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title=f"held-out pass@1 ({summary['heldout_tasks']} tasks, T={summary['temperature']})")
    table.add_column("domain")
    table.add_column("after SFT", justify="right")
    table.add_column("after RL", justify="right")
    for domain, value in summary["per_domain_before"].items():
        table.add_row(domain, f"{value:.1%}", f"{summary['per_domain_after'][domain]:.1%}")
    table.add_row("[bold]all (sampled)", f"{summary['heldout_pass@1_before']:.1%}",
                  f"{summary['heldout_pass@1_after']:.1%}")
    table.add_row("[bold]all (greedy)", f"{summary['heldout_greedy_pass@1_before']:.1%}",
                  f"{summary['heldout_greedy_pass@1_after']:.1%}")
    console.print(table)
    console.print(f"wall time {summary['wall_time_s']:.0f} s")
    evaluated, planned = summary.get("rl_step_evaluated"), summary.get("rl_steps_planned")
    if evaluated is not None and planned is not None and evaluated < planned:
        console.print(f"RL stopped at step {evaluated} of {planned} (train.max_time_s); run the same command "
                      "again to continue (the evaluation after RL is then redone)")
