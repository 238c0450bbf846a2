"""The repair agent in-process, and over HTTP against `tempering serve`, on the same tasks; and single-shot
pass@1 through the `openai` Python client against the same server.

    .venv/bin/python bench/agent_over_http.py RUN_DIR --tasks RUN_DIR/data/heldout.jsonl [--repairs 3]

Prints pass@1 single-shot and within the repairs, the stuck rate and the wall time of each arm. Greedy
decoding, so the arms should agree (batch composition can move a near-tie).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tempering.agent.commands import run_settings
from tempering.data import load_tasks
from tempering.envs.base import EnvContext
from tempering.envs.code import CodeEnv, program_of
from tempering.sandbox import LocalSandbox


def repair_cli(model: str, tasks: str, repairs: int, extra: list[str]) -> tuple[dict, float]:
    started = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tempering.cli",
            "repair",
            model,
            "--tasks",
            tasks,
            "--repairs",
            str(repairs),
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout[out.stdout.index("{") :]), time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--tasks", required=True)
    p.add_argument("--repairs", type=int, default=3)
    args = p.parse_args()
    from tempering.checkpoint import resolve_model

    settings = run_settings(resolve_model(args.run_dir))
    env_args = [
        "--feedback-chars",
        str(settings.get("feedback_chars", 400)),
        "--tokenizer",
        args.run_dir,
        "--chat-format",
        settings.get("chat_format", "auto"),
        "--max-context",
        str(settings.get("max_context", 1024)),
    ]
    if settings.get("code_instruction"):
        env_args += ["--instruction", settings["code_instruction"]]
    local, local_s = repair_cli(args.run_dir, args.tasks, args.repairs, [])

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "tempering.cli", "serve", args.run_dir, "--port", str(port), "--name", "m"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ.copy(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        remote, remote_s = repair_cli(
            f"{url}/v1", args.tasks, args.repairs, env_args + ["--concurrency", "32"]
        )

        tasks = load_tasks(args.tasks)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        ctx = EnvContext(None, options={"code_instruction": settings.get("code_instruction")})

        def ask(task) -> str:
            prompt = CodeEnv(ctx).reset(task)
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0
            )
            return r.choices[0].message.content

        started = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, tasks))
        with LocalSandbox(workers=2) as sandbox:
            results = sandbox.run_tests_batch([(t, program_of(t, a)) for t, a in zip(tasks, answers)])
        openai_pass, openai_s = sum(r.all_passed for r in results) / len(tasks), time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=30)

    print(f"{'arm':<26} {'single-shot':>11} {'w/ repairs':>10} {'stuck':>6} {'wall s':>7}")
    for name, r, s in (("agent, in-process", local, local_s), ("agent over HTTP (serve)", remote, remote_s)):
        print(
            f"{name:<26} {r['first_turn_pass@1']:>11.1%} {r['pass@1']:>10.1%} "
            f"{r['stuck_rate']:>6.1%} {s:>7.1f}"
        )
    print(f"{'openai client, one shot':<26} {openai_pass:>11.1%} {'':>10} {'':>6} {openai_s:>7.1f}")


if __name__ == "__main__":
    main()
