"""Throughput of `tempering serve`: requests/s and generated tokens/s at 1, 4 and 16 concurrent clients;
and how it holds up under abuse (a flood of requests, a client that hangs up).

    .venv/bin/python bench/serve_throughput.py MODEL [--requests 64] [--clients 1 4 16] [--max-tokens 48]
                                               [--old CHECKOUT] [--flood 300]

Starts a real server on loopback for each arm (batching on: --max-batch 32; and the baseline, batching
off: --max-batch 1), sends chat completions of held-out task prompts (T=1.0) from N client threads with
the OpenAI client, and prints req/s, tokens/s, latency p50/p95 and the batched/unbatched ratio.
`--old CHECKOUT` adds the same batched arm served by another checkout's code (its src/ first on the path),
e.g. a worktree of the previous main, for a before/after in one run.

Then the flood figure, for each server (this one, and --old's): one client opens a long streaming
request and hangs up after a few tokens, and a small request right after it is timed against the same
small request alone; then FLOOD requests arrive at once while another process polls /health every 50 ms: how
many got 200 and how many 429, and the slowest /health answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from record import write_record  # bench/record.py, beside this script

from tempering.data import generate_tasks


def start(
    model: str, max_batch: int, threads: int, checkout: str | None = None
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ.copy()
    if checkout:
        env["PYTHONPATH"] = os.path.join(checkout, "src")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tempering.cli",
            "serve",
            model,
            "--port",
            str(port),
            "--name",
            "m",
            "--max-batch",
            str(max_batch),
            "--threads",
            str(threads),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def arm(url: str, prompts: list[str], clients: int, n: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

    def one(i: int) -> tuple[float, int]:
        started = time.perf_counter()
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
        )
        return time.perf_counter() - started, r.usage.completion_tokens

    one(0)  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - started
    latencies = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "req/s": n / wall,
        "tok/s": tokens / wall,
        "p50": statistics.median(latencies),
        "p95": latencies[int(0.95 * (len(latencies) - 1))],
        "tokens/req": tokens / n,
    }


def hang_up(url: str, prompt: str, small: int = 8, repeats: int = 5) -> dict:
    """The small request alone (median of `repeats`), then right after a long streaming request whose
    client read 3 chunks and hung up (median of `repeats`)."""
    messages = [{"role": "user", "content": prompt}]

    def small_request() -> float:
        started = time.perf_counter()
        httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": messages, "max_tokens": small, "temperature": 0},
            timeout=600,
        ).raise_for_status()
        return time.perf_counter() - started

    alone = statistics.median(small_request() for _ in range(repeats))
    context = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    after = []
    for i in range(repeats):  # as many tokens as the context holds (the server cuts it to what fits)
        long = {"messages": messages, "max_tokens": context, "temperature": 1.0, "seed": i, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=600) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        after.append(small_request())
    return {"alone": alone, "after_hang_up": statistics.median(after)}


POLL = """
import sys, threading, time, httpx
url, stop, out = sys.argv[1], threading.Event(), []
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with httpx.Client(timeout=60) as client:
    while not stop.is_set():
        started = time.perf_counter()
        client.get(url + "/health")
        out.append(time.perf_counter() - started)
        time.sleep(0.05)
print(" ".join(f"{x:.6f}" for x in out))
"""


def flood(url: str, prompt: str, n: int, max_tokens: int) -> dict:
    """`n` chat requests at once (one connection each) while another process polls /health every 50 ms
    (its own interpreter, so that the flood's client does not delay the poll it measures)."""
    poller = subprocess.Popen(
        [sys.executable, "-c", POLL, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    time.sleep(0.5)  # it polls before the flood too

    async def run() -> tuple[list[int], float]:
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 1.0,
            }
            started = time.perf_counter()
            answers = await asyncio.gather(
                *(client.post(f"{url}/v1/chat/completions", json={**body, "seed": i}) for i in range(n))
            )
            return [a.status_code for a in answers], time.perf_counter() - started

    codes, wall = asyncio.run(run())
    health = [float(x) for x in poller.communicate("")[0].split()]
    return {
        "200": codes.count(200),
        "429": codes.count(429),
        "other": n - codes.count(200) - codes.count(429),
        "health_max_s": max(health),
        "health_p50_s": statistics.median(health),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--old", help="a checkout whose code serves an extra batched arm (e.g. the previous main)")
    p.add_argument("--flood", type=int, default=300, help="requests sent at once in the flood (0: no flood)")
    p.add_argument(
        "--record", metavar="PATH", help="also write the batched server's figures as a result record"
    )
    args = p.parse_args()
    prompts = [t.prompt for t in generate_tasks(8, 64, seed=1234)[1]]
    rows, abuse = {}, {}
    arms = [("batched", 32, None), ("unbatched", 1, None)] + (
        [("old main", 32, args.old)] if args.old else []
    )
    for label, max_batch, checkout in arms:
        proc, url = start(args.model, max_batch, args.threads, checkout)
        try:
            for c in args.clients:
                rows[(label, c)] = arm(url, prompts, c, args.requests, args.max_tokens)
            if args.flood and max_batch > 1:
                abuse[label] = {
                    **hang_up(url, prompts[0]),
                    **flood(url, prompts[1], args.flood, args.max_tokens),
                }
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{'server':<10} {'clients':>7} {'req/s':>8} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} {'tok/req':>7}")
    for (label, c), r in rows.items():
        print(
            f"{label:<10} {c:>7} {r['req/s']:>8.2f} {r['tok/s']:>8.1f} {r['p50']:>7.3f} {r['p95']:>7.3f} "
            f"{r['tokens/req']:>7.1f}"
        )
    for c in args.clients:
        b, u = rows[("batched", c)], rows[("unbatched", c)]
        print(
            f"batched / unbatched at {c:>2} clients: {b['tok/s'] / u['tok/s']:.2f}x tokens/s"
            + (
                f"; batched / old main: {b['tok/s'] / rows[('old main', c)]['tok/s']:.2f}x tokens/s, p50 "
                f"{b['p50'] / rows[('old main', c)]['p50']:.2f}x"
                if args.old
                else ""
            )
        )
    for label, a in abuse.items():
        print(
            f"{label}: small request alone {a['alone']:.3f} s, right after a hung-up long one "
            f"{a['after_hang_up']:.3f} s ({a['after_hang_up'] / a['alone']:.2f}x); flood of {args.flood}: "
            f"{a['200']} x 200, {a['429']} x 429, {a['other']} other in {a['wall_s']:.1f} s; /health p50 "
            f"{a['health_p50_s'] * 1000:.1f} ms, slowest {a['health_max_s'] * 1000:.1f} ms"
        )
    if args.record:
        most = max(args.clients)
        b, u = rows[("batched", most)], rows[("unbatched", most)]
        write_record(
            args.record,
            name="serve-throughput",
            figure=f"`tempering serve`: {b['tok/s']:.0f} tokens/s, {b['req/s']:.1f} requests/s at {most} clients "
            f"({b['tok/s'] / u['tok/s']:.1f}x batching off)",
            unit="tokens/s",
            value=round(b["tok/s"], 1),
            values={
                f"{k}/{c} clients": round(r[k], 3)
                for (label, c), r in rows.items()
                if label == "batched"
                for k in ("req/s", "tok/s", "p50")
            },
            notes=f"Model {args.model}; {args.requests} requests of {args.max_tokens} tokens at most, T=1.0.",
        )


if __name__ == "__main__":
    main()
