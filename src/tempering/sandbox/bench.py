"""Throughput and latency of the sandbox, next to the naive ways of running a program.

Used by `tempering sandbox bench` (the warm pool only) and `bench/sandbox_throughput.py` (everything).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tempering.sandbox.execution import SandboxLimits
from tempering.sandbox.grading import test_requests
from tempering.sandbox.isolation import WORKER_ENV, bwrap_args, next_worker_ids, resolve
from tempering.sandbox.pool import LocalSandbox, default_python
from tempering.types import Task, TestCase

TRIVIAL = "x = 1 + 1\n"
TASK = Task(id="bench", domain="bench", prompt="", entry_point="add",
            tests=[TestCase(input=[i, i + 1], output=2 * i + 1) for i in range(10)])
SOLUTION = "def add(a, b):\n    return a + b\n"


@dataclass
class Row:
    method: str
    workload: str
    concurrency: int
    n: int
    per_s: float
    p50_ms: float
    p95_ms: float
    ok: int


def _timed(fn, items, concurrency: int) -> tuple[float, list[float], list[bool]]:
    def one(item):
        t = time.perf_counter()
        ok = fn(item)
        return time.perf_counter() - t, ok

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        out = list(pool.map(one, items))
    return time.perf_counter() - start, [o[0] for o in out], [o[1] for o in out]


def _row(method, workload, concurrency, n, elapsed, lat, oks) -> Row:
    lat_ms = sorted(x * 1000 for x in lat)
    p95 = lat_ms[min(len(lat_ms) - 1, int(0.95 * len(lat_ms)))]
    return Row(method, workload, concurrency, n, n / elapsed, statistics.median(lat_ms), p95, sum(oks))


def bench_pool(concurrency: int, n: int, workload: str, isolation: str = "auto") -> Row:
    """The warm fork-server pool with `concurrency` workers."""
    with LocalSandbox(SandboxLimits(), workers=concurrency, isolation=isolation) as sb:
        if workload == "trivial":
            req = sb.request(TRIVIAL)

            def fn(_):
                return sb.execute(req)["status"] == "ok"
        else:
            [req] = test_requests(TASK, SOLUTION, sb.limits)

            def fn(_):
                return all(c and c.get("ok") for c in sb.execute(req)["calls"])

        fn(None)  # warm
        elapsed, lat, oks = _timed(fn, range(n), concurrency)
        return _row(f"pool ({sb.backend})", workload, concurrency, n, elapsed, lat, oks)


def _program(workload: str) -> str:
    if workload == "trivial":
        return TRIVIAL
    calls = "\n".join(f"assert add({t.input[0]}, {t.input[1]}) == {t.output}" for t in TASK.tests)
    return SOLUTION + calls + "\n"


def bench_subprocess(concurrency: int, n: int, workload: str) -> Row:
    """Baseline: a fresh interpreter per execution (`subprocess.run`), no isolation."""
    python, code = default_python(), _program(workload)

    def fn(_):
        return subprocess.run([python, "-c", code], capture_output=True, env={}, timeout=10).returncode == 0

    elapsed, lat, oks = _timed(fn, range(n), concurrency)
    return _row("subprocess.run", workload, concurrency, n, elapsed, lat, oks)


def bench_bwrap_per_exec(concurrency: int, n: int, workload: str) -> Row | None:
    """Baseline: a fresh bubblewrap container (same options as the pool's) per execution."""
    iso = resolve("auto", default_python())
    if iso.backend != "bwrap":
        return None
    code = _program(workload)
    ids = next_worker_ids()
    run_as = {"user": ids.program, "group": ids.program, "extra_groups": []} if ids is not None else {}
    argv = [iso.bwrap, *bwrap_args(iso.scratch_mb), "--", iso.python, "-s", "-B", "-c", code]

    def fn(_):
        return subprocess.run(argv, capture_output=True, env=WORKER_ENV, timeout=10, **run_as).returncode == 0

    elapsed, lat, oks = _timed(fn, range(n), concurrency)
    return _row("bwrap per execution", workload, concurrency, n, elapsed, lat, oks)


def format_table(rows: list[Row]) -> str:
    head = f"{'method':<22} {'workload':<12} {'conc':>4} {'n':>5} {'exec/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'ok':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.method:<22} {r.workload:<12} {r.concurrency:>4} {r.n:>5} {r.per_s:>8.1f} "
                     f"{r.p50_ms:>8.1f} {r.p95_ms:>8.1f} {r.ok:>5}")
    return "\n".join(lines)
