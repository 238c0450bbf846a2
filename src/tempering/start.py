"""The model RL starts from: `model.path` resolved once, a registry model, or the tiny model built from the
run's tasks (`base_model_dir`); then the SFT warm-up on reference solutions (`sft_stage`), which stops at a
step count or, with `sft.stop_at`, when the model reaches a pass rate on validation tasks of its own."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from tempering.checkpoint import resolve_model
from tempering.envs import EnvContext, env_context, make_env
from tempering.envs.tools import tool_declarations
from tempering.errors import ConfigError
from tempering.eval.evaluate import validation_metrics
from tempering.inference.chat import chat_format
from tempering.inference.engine import SamplingParams, make_engine
from tempering.models.loading import (
    build_tiny_model,
    compute_dtype,
    load_model,
    load_tokenizer,
    num_parameters,
    save_model,
)
from tempering.models.lora import is_adapter_dir
from tempering.models.registry import prepare as prepare_model
from tempering.models.tokenizer import train_tokenizer
from tempering.sandbox import Sandbox
from tempering.seeding import step_seed
from tempering.training.sft import encode_transcript, run_sft
from tempering.training.transcripts import transcript_text
from tempering.workspace import START_RECORD, Workspace, recorded_start, write_json


def base_model_dir(ws: Workspace, sandbox: Sandbox | None = None) -> Path:
    """The starting model: `model.path`, a registry model (`model.name`, prepared once into the cache), or
    the tiny default built (once) into RUN_DIR/base."""
    cfg = ws.cfg
    if cfg.model.path:  # a model directory, or a checkpoint or run directory (its newest model)
        return start_model(ws)
    if cfg.model.name:
        return prepare_model(cfg.model.name, log=ws.log)
    base = ws.run_dir / "base"
    if not (base / "config.json").is_file():
        # Prompts of every training task, solutions only of SFT tasks: RL never sees a reference solution.
        sft_ids = {t.id for t in ws.sft_tasks}
        texts = [transcript_text(t, tr) for t, tr in ws.transcripts(sandbox)]
        texts += [t.prompt for t in ws.rl_tasks if t.id not in sft_ids]
        tokenizer = train_tokenizer(texts, vocab_size=cfg.model.vocab_size)
        m = cfg.model
        model = build_tiny_model(
            tokenizer,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            intermediate_size=m.intermediate_size,
            max_length=m.max_length,
            seed=cfg.run.seed,
        )
        tmp = ws.run_dir / "base.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tokenizer, tmp)
        shutil.rmtree(base, ignore_errors=True)
        os.replace(tmp, base)
        ws.log(
            f"built tiny model: {num_parameters(model) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}"
        )
    return base


def start_model(ws: Workspace) -> Path:
    """`model.path`, resolved once when the run begins and recorded in RUN_DIR/start.json: a run or
    checkpoint directory names its newest model at that moment, and a resumed run keeps that one (its KL
    reference and its evaluation before RL must not move when the other run goes on). A LoRA adapter
    directory (continuing a LoRA run) is merged into its base once, into RUN_DIR/start: this run's own
    adapters then have a plain model as their base, which its checkpoints, export and serve can load."""
    if (recorded := recorded_start(ws.run_dir, ws.cfg.model.path)) is not None:
        return recorded
    path = resolve_model(ws.cfg.model.path)
    if is_adapter_dir(path):
        merged = ws.run_dir / "start"
        tmp = ws.run_dir / "start.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(load_model(path, dtype=ws.cfg.model.dtype), load_tokenizer(path), tmp)
        shutil.rmtree(merged, ignore_errors=True)
        os.replace(tmp, merged)
        ws.log(f"start model: the adapters of {path} merged into their base, saved as {merged}")
        path = merged
    write_json(ws.run_dir / START_RECORD, {"model.path": ws.cfg.model.path, "resolved": str(path.resolve())})
    return path.resolve()


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
    ctx = env_context(
        cfg, sandbox
    )  # the prompt as an episode shows it (e.g. after env.options.code_instruction)
    examples = [
        encode_transcript(
            fmt, make_env(t, ctx).reset(t), tr, tool_declarations(t) if t.env == "tool" else None
        )
        for t, tr in ws.transcripts(sandbox)
    ]
    check = sft_check(ws, model, tokenizer, ctx) if ws.sft_val_tasks else None
    ran = 0
    with (out / "metrics.jsonl").open("w") as f:

        def on_step(step: int, row: dict[str, float]) -> bool:
            nonlocal ran
            ran = step
            stop = False
            if check is not None and step % s.check_every == 0:
                row |= check(step)
                stop = row["sft/val/pass@1"] >= (s.stop_at or 1.0)
                ws.log(f"sft step {step}  validation pass@1 {row['sft/val/pass@1']:.1%}")
            f.write(json.dumps(row) + "\n")
            if step % max(1, s.steps // 10) == 0 or step == s.steps or stop:
                ws.log(f"sft step {step}/{s.steps}  loss {row['sft/loss']:.3f}" + ("  (stop_at)" * stop))
            return stop

        run_sft(
            model,
            tokenizer,
            ws.sft_tasks,
            steps=s.steps,
            batch_size=s.batch_size,
            lr=s.lr,
            warmup_steps=s.warmup_steps,
            schedule=s.schedule,
            weight_decay=s.weight_decay,
            seed=cfg.run.seed,
            on_step=on_step,
            examples=examples,
        )
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    shutil.rmtree(out / "model", ignore_errors=True)
    os.replace(tmp, out / "model")
    write_json(done, {"steps": ran, "wall_time_s": time.perf_counter() - began})
    return out / "model"


def sft_check(ws: Workspace, model, tokenizer, ctx: EnvContext):
    """`sft.stop_at`'s check: the validation row (`eval.evaluate.validation_metrics`, sampled at
    eval.temperature and greedy) of the model SFT is training, on SFT's validation tasks. One engine over
    the live weights; released after each check, as the RL loop releases its engine after an update, so the
    next check samples the weights as they are then and the SFT steps between get the cache's memory."""
    cfg = ws.cfg
    if ctx.sandbox is None:
        raise ConfigError("sft.stop_at: SFT's validation runs the tasks' tests and needs a sandbox")
    sampling = SamplingParams(cfg.eval.temperature, 1.0, cfg.rollout.max_new_tokens)
    engine = make_engine(model, tokenizer, sampling, dtype=compute_dtype(cfg.model.compute, cfg.run.device))

    def check(step: int) -> dict[str, float]:
        try:
            metrics, _ = validation_metrics(
                engine,
                ws.sft_val_tasks,
                ctx,
                seed=step_seed(cfg.run.seed, step, 3),
                max_context=cfg.env.max_context,
                chat=cfg.env.chat_format,
            )
        finally:
            engine.release()
            model.train()
        return {f"sft/{k}": v for k, v in metrics.items() if k.count("/") == 1}

    return check
