"""`tempering serve` in a subprocess on a free loopback port, started and stopped by a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir, *extra, env=None):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPERING_SERVE")} | (env or {})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tempering.cli",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--name",
            "tiny",
            "--threads",
            "1",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code in (200, 401):
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)


def stop(proc):
    proc.terminate()
    proc.wait(timeout=20)
