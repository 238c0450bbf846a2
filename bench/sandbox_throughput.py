"""Sandbox throughput and latency, side by side with the naive ways of running a program.

    .venv/bin/python bench/sandbox_throughput.py [--n 400] [--n-baseline 150]

Rows: the warm fork-server pool (bubblewrap-isolated where available), `subprocess.run` of a fresh
interpreter per execution (no isolation), and a fresh bubblewrap container per execution; each for a
trivial program and for a 10-test function task, at concurrency 1, 2 and 8 (the pool gets that many
workers). Prints a table and the ratio of the isolated pool to bubblewrap-per-execution.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess

from tempering.sandbox.bench import SOLUTION, TASK, TRIVIAL, Row, bench_pool, format_table, row, timed
from tempering.sandbox.isolation import WORKER_ENV, bwrap_args, next_worker_ids, resolve
from tempering.sandbox.pool import default_python


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

    elapsed, lat, oks = timed(fn, range(n), concurrency)
    return row("subprocess.run", workload, concurrency, n, elapsed, lat, oks)


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

    elapsed, lat, oks = timed(fn, range(n), concurrency)
    return row("bwrap per execution", workload, concurrency, n, elapsed, lat, oks)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=400, help="executions per pool measurement")
    parser.add_argument("--n-baseline", type=int, default=150, help="executions per baseline measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    args = parser.parse_args()

    print(f"# {platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}")
    rows, best = [], {}
    for workload in ("trivial", "10-test"):
        for c in args.concurrency:
            pool = bench_pool(c, args.n, workload)
            rows.append(pool)
            rows.append(bench_subprocess(c, args.n_baseline, workload))
            bw = bench_bwrap_per_exec(c, args.n_baseline, workload)
            if bw:
                rows.append(bw)
            best.setdefault(workload, []).append((pool.per_s, bw.per_s if bw else None))
    print(format_table(rows))
    for workload, pairs in best.items():
        pool_best = max(p for p, _ in pairs)
        bw_best = max((b for _, b in pairs if b), default=None)
        ratio = f", {pool_best / bw_best:.1f}x bubblewrap per execution ({bw_best:.0f}/s)" if bw_best else ""
        print(f"{workload}: best isolated pool {pool_best:.0f} executions/s{ratio}")


if __name__ == "__main__":
    main()
