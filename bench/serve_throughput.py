"""Throughput of `tempering serve`: requests/s and generated tokens/s at 1, 4 and 16 concurrent clients.

    .venv/bin/python bench/serve_throughput.py MODEL [--requests 64] [--clients 1 4 16] [--max-tokens 48]

Starts a real server on loopback for each arm (batching on: --max-batch 32; and the baseline, batching
off: --max-batch 1), sends chat completions of held-out task prompts (T=1.0) from N client threads with
the OpenAI client, and prints req/s, tokens/s, latency p50/p95 and the batched/unbatched ratio.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tempering.data import generate_tasks


def start(model: str, max_batch: int, threads: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tempering.cli", "serve", model, "--port", str(port), "--name",
                             "m", "--max-batch", str(max_batch), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
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
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                                           max_tokens=max_tokens, temperature=1.0, seed=i)
        return time.perf_counter() - started, r.usage.completion_tokens

    one(0)  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - started
    latencies = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {"req/s": n / wall, "tok/s": tokens / wall, "p50": statistics.median(latencies),
            "p95": latencies[int(0.95 * (len(latencies) - 1))], "tokens/req": tokens / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    prompts = [t.prompt for t in generate_tasks(8, 64, seed=1234)[1]]
    rows = {}
    for label, max_batch in (("batched", 32), ("unbatched", 1)):
        proc, url = start(args.model, max_batch, args.threads)
        try:
            for c in args.clients:
                rows[(label, c)] = arm(url, prompts, c, args.requests, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{'server':<10} {'clients':>7} {'req/s':>8} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} {'tok/req':>7}")
    for (label, c), r in rows.items():
        print(f"{label:<10} {c:>7} {r['req/s']:>8.2f} {r['tok/s']:>8.1f} {r['p50']:>7.3f} {r['p95']:>7.3f} "
              f"{r['tokens/req']:>7.1f}")
    for c in args.clients:
        b, u = rows[("batched", c)], rows[("unbatched", c)]
        print(f"batched / unbatched at {c:>2} clients: {b['tok/s'] / u['tok/s']:.2f}x tokens/s")


if __name__ == "__main__":
    main()
