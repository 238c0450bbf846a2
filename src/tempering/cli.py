"""The `tempering` command.

    tempering train CONFIG.yaml [key.path=value ...]     run (or resume) the recipe [--allow-config-change]
    tempering sft CONFIG.yaml [key.path=value ...]       only the supervised warm-up
    tempering eval MODEL_OR_CHECKPOINT --tasks FILE      pass@k on a task file or set (humaneval, leetcode-easy)
    tempering data generate --out DIR                    write the built-in task splits
    tempering sandbox run FILE [--lang L] [--json]       execute one program in the sandbox
    tempering sandbox doctor | serve | bench             protections; HTTP service; throughput
    tempering models list | prepare NAME                 the model registry (e.g. smollm2-135m-instruct)
    tempering report RUN_DIR [--out FILE]                summary, and a self-contained HTML report
    tempering repair MODEL_OR_URL --tasks FILE           the repair agent (write, run, read the error, retry)
    tempering serve MODEL [--port 8000]                  an OpenAI-compatible server over a local model
    tempering data from-logs LOGS... --out FILE          production error logs -> checked sandbox tasks

Bad input ends with one line `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path

from tempering.arguments import Parser, k_values, non_negative_float, non_negative_int, positive_int
from tempering.errors import Preempted, TemperingError

# ------------------------------------------------------------------------------------------ commands


def _config(args: argparse.Namespace):
    from tempering.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from tempering.pipeline import train
    from tempering.tracking.report import write_report

    cfg = _config(args)
    train(cfg, allow_config_change=args.allow_config_change)
    run_dir = Path(cfg.run.dir)
    files = {
        "summary": run_dir / "summary.json",
        "report": write_report(run_dir),
        "plot": run_dir / "plot.png",
    }
    for what, path in files.items():
        if path.is_file():
            print(f"{what:<8} {path}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from tempering.start import base_model_dir, sft_stage
    from tempering.workspace import make_sandbox, prepare

    ws = prepare(_config(args), allow_config_change=args.allow_config_change)
    with make_sandbox(ws.cfg) as sandbox:  # episodes' SFT transcripts execute code (repair feedback)
        out = sft_stage(ws, base_model_dir(ws, sandbox), sandbox)
    ws.log(f"SFT model: {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint (or a run's newest) as a plain Hugging Face model directory; LoRA adapters are merged
    into their base."""
    import shutil

    from tempering.checkpoint import resolve_model
    from tempering.models.loading import load_model, load_tokenizer

    model_dir = resolve_model(args.checkpoint)
    out = Path(args.to)
    if out.exists() and any(out.iterdir()):
        raise TemperingError(f"'{out}' exists and is not empty; export writes a fresh directory")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # Loaded and saved (not copied), so what is written is exactly what from_pretrained reads back.
    load_model(model_dir).save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(model_dir).save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    print(f"exported {model_dir} -> {out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tempering.checkpoint import resolve_model
    from tempering.data import load_tasks
    from tempering.envs import EnvContext
    from tempering.eval.evaluate import evaluate
    from tempering.inference.engine import SamplingParams, open_model
    from tempering.runtime import configure
    from tempering.sandbox import open_sandbox

    model_dir = resolve_model(args.model)
    tasks = load_tasks(args.tasks)[: args.limit]
    ks = args.k
    if max(ks) > args.samples and not args.greedy:
        raise TemperingError(f"--k {max(ks)} needs --samples >= {max(ks)}")
    configure(args.threads)
    engine = open_model(
        model_dir,
        SamplingParams(args.temperature, 1.0, args.max_new_tokens),
        device=args.device,
        compute=args.compute,
        keys=("--device", "--compute"),
    )
    with open_sandbox() as sandbox:
        # pass@k of the final attempt; with --turns > 1 also first_turn_pass@1 (feedback between attempts).
        ctx = EnvContext(sandbox, max_turns=args.turns, options={"code_instruction": args.instruction})
        report = evaluate(
            engine,
            tasks,
            ctx,
            samples=args.samples,
            ks=ks,
            greedy=args.greedy,
            max_context=args.max_context,
            seed=args.seed,
            chat=args.chat_format,
        )
    console = Console()
    table = Table(
        title=f"{model_dir}  ({report.num_tasks} tasks, "
        f"{'greedy' if args.greedy else f'{report.samples} samples at T={args.temperature}'})"
    )
    table.add_column("domain")
    table.add_column("tasks", justify="right")
    metric_names = [n for n in report.overall if all(n in s for s in report.per_domain.values())]
    for name in metric_names:
        table.add_column(name, justify="right")
    for domain, scores in report.per_domain.items():
        table.add_row(domain, str(report.domain_tasks[domain]), *(f"{scores[n]:.1%}" for n in metric_names))
    table.add_row("[bold]all", str(report.num_tasks), *(f"{report.overall[n]:.1%}" for n in metric_names))
    console.print(table)
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"model": str(model_dir), "tasks": str(args.tasks), **report.to_json()}, indent=1)
        )
        console.print(f"wrote {out}")
    return 0


def cmd_data_generate(args: argparse.Namespace) -> int:
    from tempering.config import build_config
    from tempering.data import save_tasks
    from tempering.workspace import builtin_tasks

    cfg = build_config(
        {
            "data": {
                "generator": args.generator,
                "num_train": args.num_train,
                "num_heldout": args.num_heldout,
                "seed": args.seed,
            }
        }
    )
    train, heldout = builtin_tasks(cfg)
    out = Path(args.out)
    save_tasks(train, out / "train.jsonl")
    save_tasks(heldout, out / "heldout.jsonl")
    print(f"wrote {len(train)} training and {len(heldout)} held-out tasks to {out}")
    return 0


def cmd_data_pass_rates(args: argparse.Namespace) -> int:
    from tempering.pipeline import measure_pass_rates

    out = Path(args.out)
    if out.is_dir():
        raise TemperingError(f"--out '{out}' is a directory")
    rates = measure_pass_rates(_config(args), args.per_family, args.samples, args.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**rates, "config": str(args.config)}, indent=1) + "\n")
    for name, f in sorted(rates["families"].items(), key=lambda kv: -kv[1]["pass_rate"]):
        print(
            f"{name:24s} {f['pass_rate']:6.1%}  pass@{rates['samples']} {f['pass@k']:6.1%}  "
            f"({f['tasks']} tasks x {rates['samples']})"
        )
    print(
        f"wrote {out}: {len(rates['families'])} families, {rates['tasks']} tasks, overall {rates['pass@1']:.1%}"
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tempering.summary import print_summary
    from tempering.tracking.report import read_summary, write_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "summary.json").is_file():
        raise TemperingError(f"'{run_dir}' is not a run directory (no metrics.jsonl or summary.json)")
    if summary := read_summary(run_dir):  # {} while the run has not finished
        print_summary(Console(), summary)
    print(f"wrote {write_report(run_dir, Path(args.out) if args.out else None)}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from tempering.models.registry import MODELS, cache_root, prepared

    for name, e in MODELS.items():
        where = prepared(name)
        print(
            f"{name}  {'prepared: ' + str(where) if where else 'not prepared'}\n    {e.about}\n"
            f"    from {e.package}=={e.version}:{e.file}"
        )
    print(f"cache: {cache_root()} (TEMPERING_CACHE)")
    return 0


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from tempering.models.registry import entry, prepare

    entry(args.name)  # an unknown name fails here, in one line
    print(prepare(args.name, Path(args.cache) / "models" if args.cache else None, log=print))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tempering import __version__

    parser = Parser(prog="tempering", description="RL post-training with execution feedback")
    parser.add_argument("--version", action="version", version=f"tempering {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parsers(sub)
    _add_eval_parser(sub)
    data = _add_data_parsers(sub)
    from tempering.sandbox.commands import add_parsers as add_sandbox_parsers

    add_sandbox_parsers(sub)
    _add_model_parsers(sub)
    from tempering.agent.commands import add_parsers as add_agent_parsers

    add_agent_parsers(sub, data)
    _add_report_parser(sub)
    return parser


def _add_run_parsers(sub) -> None:
    for name, fn, text in (
        ("train", cmd_train, "run (or resume) a recipe: SFT warm-up, RL, evaluation"),
        ("sft", cmd_sft, "run only the supervised warm-up of a recipe"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", help="recipe YAML, or a run directory (uses its config.yaml)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.lr=1e-4 run.dir=runs/x")
        p.add_argument(
            "--allow-config-change",
            action="store_true",
            help="resume a run directory with a config that differs from its recorded one beyond the "
            "keys that may change (train.steps, train.max_time_s, run.threads, checkpoint.*, "
            "tracking.*, ...); the change is recorded in RUN_DIR/config_history",
        )
        p.set_defaults(fn=fn)


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="pass@k of a model or checkpoint on a task file")
    p.add_argument("model", help="model, checkpoint or run directory (its newest model), or registry name")
    p.add_argument(
        "--tasks",
        required=True,
        help="task file (JSONL, Parquet, datasets directory) or a named set: "
        "humaneval, leetcode-easy, leetcode-medium, leetcode-hard",
    )
    p.add_argument(
        "--instruction", help="code tasks: text put before each prompt (env.options.code_instruction)"
    )
    p.add_argument("--limit", type=positive_int, help="only the first N tasks")
    p.add_argument("--samples", type=positive_int, default=1, help="samples per task")
    p.add_argument("--k", type=k_values, default="1", help="comma-separated k values, e.g. 1,5")
    p.add_argument("--temperature", type=non_negative_float, default=1.0)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (one sample)")
    p.add_argument("--max-new-tokens", type=positive_int, default=48)
    p.add_argument(
        "--turns", type=positive_int, default=1, help="attempts per episode, with feedback between them"
    )
    p.add_argument(
        "--max-context", type=positive_int, default=1024, help="episodes: context budget in tokens"
    )
    p.add_argument(
        "--chat-format",
        default="auto",
        choices=["auto", "plain", "template"],
        help="episodes: the format the model was trained with (env.chat_format)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, mps")
    p.add_argument(
        "--compute",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="sampling precision (model.compute): bfloat16 samples from a bf16 copy; auto where faster",
    )
    p.add_argument("--out", help="write the report as JSON here")
    p.set_defaults(fn=cmd_eval)


def _add_data_parsers(sub):
    """`data generate`, `data pass-rates`; the group, which `agent.commands` adds `from-logs` to."""
    data = sub.add_parser("data", help="task data").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("generate", help="write the built-in train/held-out task files")
    p.add_argument("--out", required=True)
    p.add_argument("--num-train", type=positive_int, default=20000)
    p.add_argument("--num-heldout", type=non_negative_int, default=512)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--generator", default="code", choices=["code", "tools", "answer", "reasoning_gym"])
    p.set_defaults(fn=cmd_data_generate)
    p = data.add_parser(
        "pass-rates",
        help="the start model's pass rate per task family on a recipe's training "
        "tasks (the file data.pass_rates reads)",
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--out", required=True)
    p.add_argument("--per-family", type=positive_int, default=8, help="tasks per family (template or task)")
    p.add_argument("--samples", type=positive_int, default=4, help="samples per task")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_data_pass_rates)
    return data


def _add_model_parsers(sub) -> None:
    """`export` and `models list | prepare`."""
    p = sub.add_parser("export", help="write a checkpoint as a plain Hugging Face model directory")
    p.add_argument(
        "checkpoint", help="checkpoint, run (its newest checkpoint) or model directory, or registry name"
    )
    p.add_argument("--to", required=True, help="output directory (created; must not hold files)")
    p.set_defaults(fn=cmd_export)

    models = sub.add_parser("models", help="the model registry").add_subparsers(
        dest="models_command", required=True
    )
    p = models.add_parser("list", help="registry models and whether they are prepared")
    p.set_defaults(fn=cmd_models_list)
    p = models.add_parser(
        "prepare", help="convert a registry model into a Hugging Face directory in the cache"
    )
    p.add_argument("name")
    p.add_argument("--cache", help="cache directory (default $TEMPERING_CACHE or ~/.cache/tempering)")
    p.set_defaults(fn=cmd_models_prepare)


def _add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="print a run's summary and write its HTML report (RUN_DIR/report.html)")
    p.add_argument("run_dir")
    p.add_argument("--out", help="HTML file to write (default RUN_DIR/report.html)")
    p.set_defaults(fn=cmd_report)


def main(argv: list[str] | None = None) -> int:
    from tempering.runtime import fixed_mmap_threshold, quiet_libraries

    fixed_mmap_threshold()  # every command, also those that never configure threads
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        return args.fn(args)
    except Preempted as e:
        print(f"preempted: {e}", file=sys.stderr)
        return 0
    except TemperingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk anywhere else (a run's own writes name their file: DiskFullError)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(
            f"error: disk full{f' writing {e.filename}' if e.filename else ''} ({e.strerror}): make room and run "
            "the same command again",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
