"""Throughput and latency of the sandbox's warm worker pool: `tempering sandbox bench`.

`bench/sandbox_throughput.py` sets it beside the naive ways of running a program.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tempering.sandbox.execution import SandboxLimits
from tempering.sandbox.grading import test_requests
from tempering.sandbox.pool import LocalSandbox
from tempering.types import Task, TestCase

TRIVIAL = "x = 1 + 1\n"
TASK = Task(
    id="bench",
    domain="bench",
    prompt="",
    entry_point="add",
    tests=[TestCase(input=[i, i + 1], output=2 * i + 1) for i in range(10)],
)
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


def timed(fn, items, concurrency: int) -> tuple[float, list[float], list[bool]]:
    def one(item):
        t = time.perf_counter()
        ok = fn(item)
        return time.perf_counter() - t, ok

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        out = list(pool.map(one, items))
    return time.perf_counter() - start, [o[0] for o in out], [o[1] for o in out]


def row(method, workload, concurrency, n, elapsed, lat, oks) -> Row:
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
        elapsed, lat, oks = timed(fn, range(n), concurrency)
        return row(f"pool ({sb.backend})", workload, concurrency, n, elapsed, lat, oks)


def format_table(rows: list[Row]) -> str:
    head = f"{'method':<22} {'workload':<12} {'conc':>4} {'n':>5} {'exec/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'ok':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.method:<22} {r.workload:<12} {r.concurrency:>4} {r.n:>5} {r.per_s:>8.1f} "
            f"{r.p50_ms:>8.1f} {r.p95_ms:>8.1f} {r.ok:>5}"
        )
    return "\n".join(lines)
