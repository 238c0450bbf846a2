"""The sandbox's commands: `tempering sandbox run | doctor | serve | bench`.

tempering sandbox run FILE [--lang L] [--json]   execute one program and print what it did
tempering sandbox doctor                         which protections are active on this machine
tempering sandbox serve [--host H --port P]      the sandbox as an HTTP service
tempering sandbox bench                          throughput and latency of the warm worker pool
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tempering.arguments import port_number, positive_float, positive_int
from tempering.errors import TemperingError


def cmd_sandbox_run(args: argparse.Namespace) -> int:
    from tempering.config_sections import SandboxSection
    from tempering.sandbox import open_sandbox

    path = Path(args.file)
    if not path.is_file():
        raise TemperingError(f"program file '{path}' does not exist")
    stdin = Path(args.stdin).read_text() if args.stdin else None
    with open_sandbox(SandboxSection(workers=1, isolation=args.isolation)) as sandbox:
        result = sandbox.run(
            path.read_text(),
            language=args.lang,
            stdin=stdin,
            timeout_s=args.timeout,
            memory_mb=args.memory_mb,
        )
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        print(
            f"[{result.status}] exit={result.exit_code} wall={result.wall_time_s:.3f}s cpu={result.cpu_time_s:.3f}s",
            file=sys.stderr,
        )
    return 0 if result.status == "ok" else 1


def cmd_sandbox_doctor(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tempering.config_sections import SandboxSection
    from tempering.sandbox import open_sandbox
    from tempering.sandbox.service import sandbox_token, service_protection

    with open_sandbox(SandboxSection(workers=1, isolation=args.isolation)) as sandbox:
        checks = {lang: sandbox.run(code, language=lang).status for lang, code in _HELLO.items()}
        table = Table(
            title=f"sandbox backend: {sandbox.backend}"
            + (f" ({sandbox.isolation.why_not_bwrap})" if sandbox.isolation.why_not_bwrap else "")
        )
        table.add_column("protection")
        table.add_column("active")
        table.add_column("how")
        for p in [*sandbox.protections(), service_protection(sandbox_token())]:
            table.add_row(p.name, "[green]yes[/]" if p.active else "[red]NO[/]", p.how)
    console = Console()
    console.print(table)
    console.print(
        "languages: " + ", ".join(f"{lang} {'ok' if st == 'ok' else st}" for lang, st in checks.items())
    )
    return 0


_HELLO = {
    "python": "print('hi')",
    "c": '#include <stdio.h>\nint main(void) { puts("hi"); return 0; }\n',
    "cpp": '#include <iostream>\nint main() { std::cout << "hi" << std::endl; }\n',
    "javascript": "console.log('hi')",
    "bash": "echo hi",
}


def cmd_sandbox_serve(args: argparse.Namespace) -> int:
    from tempering.sandbox.service import ServiceLimits, sandbox_token, serve

    token = sandbox_token(args.token_file)
    limits = ServiceLimits(
        max_request_bytes=int(args.max_request_mb * (1 << 20)),
        max_pending=args.max_pending,
        client_pending=args.client_pending,
        client_concurrency=args.client_concurrency,
        max_timeout_s=args.max_timeout_s,
        max_memory_mb=args.max_memory_mb,
    )
    auth = "token required" if token else "no token (loopback only)"
    print(
        f"sandbox service on http://{args.host}:{args.port} ({args.workers} workers, {auth}); Ctrl-C stops it",
        file=sys.stderr,
    )
    serve(args.host, args.port, workers=args.workers, isolation=args.isolation, service=limits, token=token)
    return 0


def cmd_sandbox_bench(args: argparse.Namespace) -> int:
    from tempering.sandbox.bench import bench_pool, format_table

    rows = [
        bench_pool(c, args.n, w, args.isolation) for w in ("trivial", "10-test") for c in args.concurrency
    ]
    print(format_table(rows))
    return 0


def add_parsers(sub) -> None:
    """`tempering sandbox run | doctor | serve | bench`."""
    sandbox = sub.add_parser("sandbox", help="sandboxed execution").add_subparsers(
        dest="sandbox_command", required=True
    )
    isolation = {
        "choices": ["auto", "bwrap", "process"],
        "default": "auto",
        "help": "bwrap containers, plain processes, or auto (bwrap where it works)",
    }
    p = sandbox.add_parser("run", help="run one program and print what it did")
    p.add_argument("file")
    p.add_argument("--lang", default="python", choices=["python", "c", "cpp", "javascript", "bash"])
    p.add_argument("--isolation", **isolation)
    p.add_argument("--timeout", type=positive_float, default=None, help="wall-clock limit in seconds")
    p.add_argument("--memory-mb", type=positive_int, default=None)
    p.add_argument("--stdin", help="file to feed on standard input")
    p.add_argument("--json", action="store_true", help="print the ExecResult as JSON")
    p.set_defaults(fn=cmd_sandbox_run)
    p = sandbox.add_parser("doctor", help="which protections are active on this machine")
    p.add_argument("--isolation", **isolation)
    p.set_defaults(fn=cmd_sandbox_doctor)
    p = sandbox.add_parser("serve", help="run the sandbox as an HTTP service")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=port_number, default=8080)
    p.add_argument("--workers", type=positive_int, default=2)
    p.add_argument(
        "--max-pending", type=positive_int, default=1024, help="executions held at once; more get 429"
    )
    p.add_argument(
        "--client-pending", type=positive_int, default=256, help="executions one client may hold at once"
    )
    p.add_argument(
        "--client-concurrency",
        type=positive_int,
        default=None,
        help="executions of one client running at once (default: all workers)",
    )
    p.add_argument(
        "--max-request-mb", type=positive_float, default=16, help="largest request body; more get 413"
    )
    p.add_argument(
        "--max-timeout-s", type=positive_float, default=60.0, help="cap on a request's time limits"
    )
    p.add_argument("--max-memory-mb", type=positive_int, default=2048, help="cap on a request's memory limit")
    p.add_argument(
        "--token-file",
        help="file holding the shared secret clients must send (default: "
        "$TEMPERING_SANDBOX_TOKEN); required on a non-loopback --host",
    )
    p.add_argument("--isolation", **isolation)
    p.set_defaults(fn=cmd_sandbox_serve)
    p = sandbox.add_parser("bench", help="throughput and latency of the warm worker pool")
    p.add_argument("--n", type=positive_int, default=400, help="executions per measurement")
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 2, 8])
    p.add_argument("--isolation", **isolation)
    p.set_defaults(fn=cmd_sandbox_bench)
