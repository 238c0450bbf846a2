"""The deployment side's commands: `tempering repair`, `tempering serve`, `tempering data from-logs`.

Everything a command needs is checked before it starts working - the task file, the model path or the
server's URL, the alert settings - and each problem is one `error:` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tempering.arguments import fraction, non_negative_float, non_negative_int, port_number, positive_int
from tempering.errors import TemperingError

if TYPE_CHECKING:
    from tempering.config_sections import EnvSection
    from tempering.envs import EnvContext
    from tempering.inference.engine import Engine, SamplingParams


def _alert(args: argparse.Namespace, metrics):
    from tempering.agent.monitor import AlertRule

    if not args.alert_webhook:
        return None
    if not args.alert_webhook.startswith(("http://", "https://")):
        raise TemperingError(f"--alert-webhook '{args.alert_webhook}' is not an http(s) URL")
    try:
        return AlertRule(
            args.alert_webhook,
            threshold=args.alert_threshold,
            window=args.alert_window,
            min_events=min(args.alert_window, args.alert_min_events),
            metrics=metrics,
        )
    except ValueError as e:
        raise TemperingError(str(e)) from None


def run_settings(model_dir: Path) -> EnvSection | None:
    """The environment settings of the run a model comes from - feedback length, instruction, chat format,
    context budget: the `env` section of the config.yaml of the run or checkpoint that the model directory
    belongs to (`checkpoint.owner_config`), read with `load_config` and from no other file; None for a model
    of no run. The config's keys and types are checked, nothing it names is imported (`checks=False`)."""
    from tempering.checkpoint import owner_config
    from tempering.config import load_config

    found = owner_config(model_dir)
    if found is None:
        return None
    try:
        return load_config(found, checks=False).env
    except TemperingError as e:
        raise TemperingError(f"'{found}': the model's run config cannot be read ({e})") from None


def _tasks(args: argparse.Namespace):
    from pydantic import ValidationError

    from tempering.data import load_tasks
    from tempering.types import Task, TestCase

    if bool(args.tasks) == bool(args.prompt):
        raise TemperingError("give either --tasks FILE or --prompt TEXT with --tests FILE")
    if args.tasks:
        tasks = load_tasks(args.tasks)[: args.limit]
    else:
        if not args.tests:
            raise TemperingError("--prompt needs --tests FILE (a JSON list of test cases)")
        prompt = args.prompt
        if prompt.startswith("@"):
            try:
                prompt = Path(prompt[1:]).read_text()
            except OSError as e:
                raise TemperingError(
                    f"--prompt '{args.prompt}': cannot read the file ({e.strerror})"
                ) from None
        try:
            tests = [TestCase.model_validate(t) for t in json.loads(Path(args.tests).read_text())]
        except (OSError, ValueError) as e:
            raise TemperingError(f"--tests '{args.tests}': {str(e).splitlines()[0]}") from None
        try:
            tasks = [
                Task(id="prompt", domain="prompt", prompt=prompt, entry_point=args.entry_point, tests=tests)
            ]
        except ValidationError as e:  # e.g. no test at all
            raise TemperingError(
                f"--tests '{args.tests}': {e.errors()[0]['msg'].removeprefix('Value error, ')}"
            ) from None
    if not tasks:
        raise TemperingError("no tasks to run")
    if bad := [t.id for t in tasks if t.env != "code"]:
        raise TemperingError(f"the repair agent takes code tasks; not: {', '.join(bad[:5])}")
    return tasks


def cmd_repair(args: argparse.Namespace) -> int:
    from prometheus_client import start_http_server

    from tempering.agent.monitor import JsonLog, Metrics
    from tempering.agent.repair import RepairSettings, repair
    from tempering.inference.engine import SamplingParams
    from tempering.runtime import configure
    from tempering.sandbox import open_sandbox

    tasks = _tasks(args)
    metrics = Metrics()
    alert = _alert(args, metrics)
    sampling = SamplingParams(args.temperature or 1.0, 1.0, args.max_tokens)
    configure(args.threads)
    engine, max_context, env = _repair_engine(args, sampling)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="127.0.0.1", registry=metrics.registry)
    with open_sandbox() as sandbox:
        report = repair(
            engine,
            tasks,
            _repair_context(args, env, sandbox),
            RepairSettings(args.repairs, not args.no_stuck, args.temperature <= 0, args.seed),
            max_context=max_context,
            chat=args.chat_format or (env.chat_format if env else "auto"),
            name=args.model,
            log=JsonLog(args.log),
            metrics=metrics,
            alert=alert,
        )
    _write_summary(args, {**report.summary(), "alerts": alert.fired if alert else 0})
    return 0


def _repair_engine(
    args: argparse.Namespace, sampling: SamplingParams
) -> tuple[Engine, int, EnvSection | None]:
    """The engine the agent runs on, its context, and the settings of the model's run (`run_settings`;
    None for a URL, whose run is unknown: --feedback-chars and --instruction say what it was trained with)."""
    from tempering.agent.backends import load_local
    from tempering.checkpoint import resolve_model
    from tempering.inference.engine import make_engine
    from tempering.inference.remote import is_url
    from tempering.models.loading import load_tokenizer

    if not is_url(args.model):
        model_dir = resolve_model(args.model)
        env = run_settings(model_dir)
        local = load_local(
            model_dir,
            device=args.device,
            max_context=args.max_context or (env and env.max_context),
            sampling=sampling,
            compute=args.compute,
        )
        return local.engine, local.max_context, env
    if not args.tokenizer:
        raise TemperingError(
            "a URL needs --tokenizer: the served model's tokenizer (a model, checkpoint or run "
            "directory, or a registry name), which renders the episodes' token prompts"
        )
    tokenizer = load_tokenizer(resolve_model(args.tokenizer))
    engine = make_engine(
        args.model,
        tokenizer,
        sampling,
        kind="http",
        model=args.model_name,
        concurrency=args.concurrency,
        insecure_http=args.allow_insecure_http,
    )
    return engine, args.max_context or engine.max_context or 1024, None


def _repair_context(args: argparse.Namespace, env: EnvSection | None, sandbox) -> EnvContext:
    """The code environment's context: the options given, else those of the model's run."""
    from tempering.config_sections import FEEDBACK_CHARS
    from tempering.envs import EnvContext

    return EnvContext(
        sandbox,
        feedback_chars=args.feedback_chars or (env.feedback_chars if env else FEEDBACK_CHARS),
        options={"code_instruction": args.instruction or (env and env.options.code_instruction)},
    )


def _write_summary(args: argparse.Namespace, figures: dict) -> None:
    """The run's summary, printed (and written to --out) as JSON."""
    summary = json.dumps({"model": args.model, "repairs": args.repairs, **figures}, indent=1)
    print(summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(summary)


def cmd_serve(args: argparse.Namespace) -> int:
    from tempering.agent.backends import load_local
    from tempering.agent.monitor import Metrics
    from tempering.agent.server import (
        TOKEN_ENV,
        TOKEN_FILE_ENV,
        ServeLimits,
        SessionLimits,
        check_exposure,
        serve,
    )
    from tempering.checkpoint import resolve_model
    from tempering.http import check_address, read_token
    from tempering.runtime import configure

    token = read_token(args.token_file, TOKEN_ENV, TOKEN_FILE_ENV)
    check_exposure(args.host, token)  # before the model loads (or is prepared: minutes)
    check_address(args.host, args.port)
    metrics = Metrics()
    alert = _alert(args, metrics)
    model_dir = resolve_model(args.model)
    env = run_settings(model_dir)
    configure(args.threads)
    chat = load_local(
        model_dir,
        device=args.device,
        chat=args.chat_format or (env.chat_format if env else "auto"),
        max_context=args.max_context,
        compute=args.compute,
        max_rows=args.max_batch,
        on_step=metrics.batch_size.observe,
    )
    chat.name = args.name or Path(args.model).name
    auth = "token required" if token else "no token (loopback only)"
    print(
        f"serving {chat.name} on http://{args.host}:{args.port}/v1 ({auth}); Ctrl-C stops it", file=sys.stderr
    )
    limits = ServeLimits(
        max_pending=args.max_pending,
        client_pending=args.client_pending,
        max_n=args.max_n,
        max_tokens=args.max_tokens_cap,
    )
    serve(
        chat,
        args.host,
        args.port,
        token=token,
        log_path=args.log,
        alert=alert,
        limits=limits,
        metrics=metrics,
        sessions=SessionLimits(max_sessions=args.sessions) if args.sessions else None,
    )
    return 0


def cmd_data_from_logs(args: argparse.Namespace) -> int:
    import hashlib

    from tempering.data import save_tasks
    from tempering.data.from_logs import build_tasks, read_records
    from tempering.sandbox import open_sandbox

    out = Path(args.out)
    heldout = out.with_name(out.stem + ".heldout.jsonl") if args.heldout_fraction else None
    for path in filter(None, (out, heldout)):
        if path.exists():
            raise TemperingError(
                f"'{path}' exists; from-logs writes a new file (remove it or choose another --out)"
            )
    if not 0.0 <= args.heldout_fraction < 1.0:
        raise TemperingError(f"--heldout-fraction {args.heldout_fraction} is not in [0, 1)")
    records = read_records(args.logs)
    with open_sandbox() as sandbox:
        built = build_tasks(records, sandbox, max_failing=args.max_failing)

    def held(task) -> bool:
        return int(hashlib.sha1(task.id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < args.heldout_fraction

    save_tasks([t for t in built.tasks if not held(t)], out)
    if heldout:
        save_tasks([t for t in built.tasks if held(t)], heldout)
    print(
        f"{built.records} records -> {len(built.tasks)} tasks, written to {out}"
        + (f" and {heldout} ({sum(map(held, built.tasks))} held out)" if heldout else "")
    )
    for why, n in built.dropped.most_common():
        print(f"  dropped {n}: {why}")
    return 0


def add_parsers(sub, data) -> None:
    """The commands' arguments, on the `tempering` parser (`sub`) and its `data` group."""
    parents = [_alert_options(), _model_options()]
    _add_repair_parser(sub, parents)
    _add_serve_parser(sub, parents)
    _add_from_logs_parser(data)


def _alert_options() -> argparse.ArgumentParser:
    """The alert rule's options (`_alert`), shared by `repair` and `serve`."""
    alert = argparse.ArgumentParser(add_help=False)
    alert.add_argument(
        "--alert-webhook", help="POST an alert (JSON) here when the failure rate crosses the threshold"
    )
    alert.add_argument(
        "--alert-threshold", type=fraction, default=0.5, help="failure rate that starts an incident"
    )
    alert.add_argument("--alert-window", type=positive_int, default=50, help="outcomes in the sliding window")
    alert.add_argument(
        "--alert-min-events", type=positive_int, default=10, help="outcomes needed before an alert can fire"
    )
    return alert


def _model_options() -> argparse.ArgumentParser:
    """How a local model is opened, shared by `repair` and `serve`."""
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument(
        "--chat-format",
        choices=["auto", "plain", "template"],
        help="the format the model was trained with (default: its run's env.chat_format, else auto)",
    )
    model.add_argument("--max-context", type=positive_int, help="prompt + completion budget in tokens")
    model.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1, mps")
    model.add_argument("--threads", type=positive_int, default=2)
    model.add_argument(
        "--compute",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="sampling precision: bfloat16 samples from a bf16 copy of the weights; auto where faster",
    )
    return model


def _add_repair_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("repair", parents=parents, help="the repair agent: write, run, read the error, retry")
    p.add_argument(
        "model",
        help="model, checkpoint or run directory, registry name, or an OpenAI-compatible URL "
        "(http://host:port/v1; key from $TEMPERING_API_KEY or $OPENAI_API_KEY)",
    )
    p.add_argument("--tasks", help="task file or named set (humaneval, leetcode-easy, ...)")
    p.add_argument("--prompt", help="one task's prompt (or @FILE)")
    p.add_argument("--tests", help="with --prompt: a JSON list of test cases")
    p.add_argument("--entry-point", help="with --prompt: the function the tests call")
    p.add_argument("--limit", type=positive_int, help="only the first N tasks")
    p.add_argument("--repairs", type=non_negative_int, default=3, help="attempts after the first")
    p.add_argument("--no-stuck", action="store_true", help="do not stop when the same error repeats")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="most tokens of one attempt")
    p.add_argument(
        "--feedback-chars", type=positive_int, help="longest feedback (default: the model's run, else 400)"
    )
    p.add_argument("--instruction", help="text put before each prompt (default: the model's run)")
    p.add_argument("--model-name", help="URL backends: the model to ask for (default: the server's first)")
    p.add_argument(
        "--tokenizer",
        help="URL backends: the served model's tokenizer (model/run directory or registry "
        "name), which renders the episodes' token prompts",
    )
    p.add_argument("--concurrency", type=positive_int, default=8, help="URL backends: requests in flight")
    p.add_argument(
        "--allow-insecure-http",
        action="store_true",
        help="URL backends: send the API key over plain http to a host that is not loopback",
    )
    p.add_argument("--log", help="append every attempt to this JSONL file")
    p.add_argument("--out", help="write the summary as JSON here")
    p.add_argument(
        "--metrics-port", type=port_number, help="serve Prometheus /metrics on 127.0.0.1:PORT while running"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_repair)


def _add_serve_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", parents=parents, help="an OpenAI-compatible server over a local model")
    p.add_argument("model", help="model, checkpoint or run directory, or registry name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--name", help="the model's name in /v1/models (default: the directory's name)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="most requests generated together")
    p.add_argument(
        "--max-pending",
        type=positive_int,
        default=256,
        help="requests queued or generating at once; more get 429",
    )
    p.add_argument(
        "--client-pending",
        type=positive_int,
        default=64,
        help="requests one client (address) may have queued or generating; more get 429",
    )
    p.add_argument("--max-n", type=positive_int, default=8, help="most choices per request (n)")
    p.add_argument(
        "--sessions",
        type=positive_int,
        metavar="N",
        help="record agents' calls in sessions (POST /v1/sessions), at most N open at once",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=positive_int,
        help="most new tokens a request may ask for (default: the context)",
    )
    p.add_argument(
        "--token-file",
        help="file holding the API key clients must send (default: $TEMPERING_SERVE_TOKEN); "
        "required on a non-loopback --host",
    )
    p.add_argument("--log", help="append one JSON line per request to this file")
    p.set_defaults(fn=cmd_serve)


def _add_from_logs_parser(data) -> None:
    p = data.add_parser("from-logs", help="production error logs -> deduplicated, checked sandbox tasks")
    p.add_argument("logs", nargs="+", help="JSONL logs: the repair agent's attempt logs, or error records")
    p.add_argument("--out", required=True, help="task file to write (JSONL)")
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.0,
        help="also write OUT.heldout.jsonl with this share of the tasks (for evaluation)",
    )
    p.add_argument(
        "--max-failing",
        type=positive_int,
        default=5,
        help="distinct failing programs of one request run in the sandbox, the first logged "
        "(default: %(default)s)",
    )
    p.set_defaults(fn=cmd_data_from_logs)
