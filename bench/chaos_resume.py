"""Chaos test of checkpoint/resume: runs of the smoke recipe killed with SIGKILL at random moments (some
exactly while a checkpoint is being written), resumed until done, compared with an uninterrupted run.

    .venv/bin/python bench/chaos_resume.py [--runs 20] [--s3] [--jobs 2] [--out runs/chaos]

With --s3, checkpoints are mirrored to a real S3-compatible server (moto) started on loopback, and before
some resumes the run's local checkpoints are deleted (a lost disk), so the resume must come from S3.
Prints: runs completed, kills (and how many landed during a save), runs whose metrics rows equal the
uninterrupted run's (timing_s/ and perf/ keys aside), and the most work lost by a kill, in steps, next
to the checkpoint interval.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VOLATILE = ("timing_s/", "perf/")
BASE = [
    "train.steps=12",
    "checkpoint.every=2",
    "checkpoint.keep=2",
    "eval.every=5",
    "tracking.progress=false",
]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stable(rs):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rs]


def newest_valid_step(run_dir: Path, remote) -> int:
    from tempering.checkpoint import find_latest

    latest, _ = find_latest(run_dir / "checkpoints")
    step = latest.step if latest else 0
    if remote is not None:
        for s in remote.steps():
            if s > step and remote.has_manifest(s):
                return s
    return step


def command(run_dir: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tempering.cli",
        "train",
        "configs/smoke.yaml",
        f"run.dir={run_dir}",
        *BASE,
        *extra,
    ]


def one_run(i: int, out: Path, extra: list[str], remote_for, duration: float, rng: random.Random) -> dict:
    run_dir = out / f"run{i:02d}"
    shutil.rmtree(run_dir, ignore_errors=True)
    remote = remote_for(i)
    kills, during_save, lost, disk_lost = 0, 0, [], 0
    mode = ["random", "in-save", "random"][i % 3]
    for attempt in range(12):
        proc = subprocess.Popen(
            command(run_dir, extra(i)), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        killed = False
        if attempt < 3:  # a few kills per run, then let it finish
            deadline = time.monotonic() + rng.uniform(0.3, duration)
            while proc.poll() is None:
                saving = any(p.name.endswith(".tmp") for p in (run_dir / "checkpoints").glob("step_*"))
                if (mode == "in-save" and saving) or (mode != "in-save" and time.monotonic() >= deadline):
                    written = len(rows(run_dir))
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    killed, kills = True, kills + 1
                    during_save += bool(saving)
                    lost.append(max(0, written - newest_valid_step(run_dir, remote)))
                    break
                time.sleep(0.001 if mode == "in-save" else 0.01)
        proc.wait()
        if not killed and proc.returncode != 0:
            return {"run": i, "error": f"exit status {proc.returncode}", "kills": kills}
        if killed and remote is not None and rng.random() < 0.5:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the disk is lost: resume from S3
            disk_lost += 1
        if (run_dir / "summary.json").is_file():
            break
    return {
        "run": i,
        "done": (run_dir / "summary.json").is_file(),
        "kills": kills,
        "during_save": during_save,
        "lost": lost,
        "disk_lost": disk_lost,
        "rows": stable(rows(run_dir)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--s3", action="store_true", help="mirror to a loopback S3 server (moto)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--out", default="runs/chaos")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = ROOT / args.out / ("s3" if args.s3 else "local")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    server = None
    extra = lambda i: []  # noqa: E731
    remote_for = lambda i: None  # noqa: E731
    if args.s3:
        import logging

        import s3fs
        from moto.server import ThreadedMotoServer

        from tempering.checkpoint import RemoteStore

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        endpoint = f"http://127.0.0.1:{port}"
        s3fs.S3FileSystem(key="test", secret="test", endpoint_url=endpoint).mkdir("chaos")
        storage = {"endpoint_url": endpoint, "key": "test", "secret": "test", "region": "us-east-1"}

        def extra(i):
            return [
                f"checkpoint.uri=s3://chaos/run{i:02d}",
                *(f"checkpoint.storage.{k}={v}" for k, v in storage.items()),
            ]

        def remote_for(i):
            return RemoteStore(f"s3://chaos/run{i:02d}", storage, retries=2, backoff_s=0.2)

    began = time.monotonic()
    ref_dir = out / "reference"
    subprocess.run(
        command(ref_dir, []), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    duration = time.monotonic() - began
    reference = stable(rows(ref_dir))
    lock = threading.Lock()
    results = []

    def job(i):
        r = one_run(i, out, extra, remote_for, duration, random.Random(args.seed * 1000 + i))
        with lock:
            results.append(r)
            print(
                f"run {i:02d}: done={r.get('done')} kills={r['kills']} during_save={r.get('during_save')} "
                f"lost={r.get('lost')} identical={r.get('rows') == reference}",
                flush=True,
            )

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(job, range(args.runs)))
    if server is not None:
        server.stop()

    done = sum(bool(r.get("done")) for r in results)
    identical = sum(r.get("rows") == reference for r in results)
    kills = sum(r["kills"] for r in results)
    in_save = sum(r.get("during_save", 0) for r in results)
    max_lost = max((x for r in results for x in r.get("lost", [])), default=0)
    print(
        f"\n{'S3 (moto, loopback)' if args.s3 else 'local disk'}: {args.runs} runs of {len(reference)} RL steps, "
        f"checkpoint every 2 steps; reference run {duration:.0f} s"
    )
    print(
        f"completed: {done}/{args.runs}   metrics identical to the uninterrupted run: {identical}/{args.runs}"
    )
    print(
        f"SIGKILLs: {kills} ({in_save} while a checkpoint was being written)   most steps lost by a kill: "
        f"{max_lost} (checkpoint interval 2)   wall time {time.monotonic() - began:.0f} s"
    )
    if args.s3:
        print(
            f"resumes after the local checkpoints were deleted (so from S3): "
            f"{sum(r.get('disk_lost', 0) for r in results)}"
        )


if __name__ == "__main__":
    main()
