"""An S3 outage of 30 s in the middle of a save: training goes on, the upload completes afterwards.

    .venv/bin/python bench/s3_outage.py [--outage-s 30]

A loopback S3 server (moto) sits behind a TCP proxy; the run mirrors its checkpoints through the proxy.
When the first checkpoint is being uploaded the proxy stops accepting and drops every connection for
--outage-s seconds (the server keeps its data, as a real store would), then comes back. Reports the
steps trained during the outage, the save/upload errors the run reported, and what is on S3 at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Proxy:
    """A TCP forwarder that can be switched off (refuses and drops connections) and on again."""

    def __init__(self, port: int, upstream: int):
        self.port, self.upstream, self.conns, self.listener = port, upstream, [], None
        self.up = False

    def start(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(64)
        self.up = True
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def stop(self) -> None:
        self.up = False
        self.listener.close()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.conns = []

    def _accept(self, listener) -> None:
        while self.up:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--outage-s", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/s3_outage")
    args = parser.parse_args()
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's request log
    moto_port, proxy_port = free_port(), free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
    server.start()
    direct = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=f"http://127.0.0.1:{moto_port}")
    direct.mkdir("outage")
    proxy = Proxy(proxy_port, moto_port)
    proxy.start()

    run_dir = ROOT / args.out
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "tempering.cli",
        "train",
        "configs/smoke.yaml",
        f"run.dir={run_dir}",
        f"train.steps={args.steps}",
        "checkpoint.every=5",
        "eval.every=0",
        "tracking.progress=false",
        "checkpoint.uri=s3://outage/run",
        f"checkpoint.storage.endpoint_url=http://127.0.0.1:{proxy_port}",
        "checkpoint.storage.key=test",
        "checkpoint.storage.secret=test",
        "checkpoint.storage.region=us-east-1",
        "checkpoint.upload_retries=7",
        "checkpoint.retry_backoff_s=1.0",
    ]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows_file = run_dir / "metrics.jsonl"

    def n_rows() -> int:
        return len(rows_file.read_text().splitlines()) if rows_file.is_file() else 0

    while proc.poll() is None and not (run_dir / "checkpoints" / "step_000005").is_dir():
        time.sleep(0.005)
    proxy.stop()  # the store goes away while step 5 is being uploaded
    outage_began, rows_at_outage = time.monotonic(), n_rows()
    time.sleep(args.outage_s)
    rows_after_outage = n_rows()
    proxy.start()
    output, _ = proc.communicate(timeout=900)
    direct.invalidate_cache()
    remote = sorted(p.rsplit("/", 1)[-1] for p in direct.ls("outage/run"))
    manifests = [
        n for n in remote if n.startswith("step_") and direct.exists(f"outage/run/{n}/MANIFEST.json")
    ]
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    server.stop()
    print(output[-1500:])
    print(
        f"\noutage of {args.outage_s:.0f} s began {outage_began - began:.1f} s into the run, during the upload of "
        f"step 5; steps trained during the outage: {rows_after_outage - rows_at_outage} "
        f"({rows_at_outage} -> {rows_after_outage})"
    )
    print(
        f"run exit status {proc.returncode}; steps completed {len(rows)}/{args.steps}; "
        f"on S3 afterwards: {remote}; with a verified manifest: {manifests}"
    )


if __name__ == "__main__":
    main()
