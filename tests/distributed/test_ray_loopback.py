"""A local Ray run as a hostile neighbour sees it: every socket of the run's process tree on loopback, a
client without the cluster's token refused (one with it let in), and after `kill -9` of the driver no
process of the cluster left running, let alone listening."""

import ipaddress
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.runs import ROOT

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.xdist_group("ray")]

GCS_PROBE = """
import os, sys
os.environ["RAY_AUTH_MODE"] = "token" if len(sys.argv) > 2 else "disabled"
if len(sys.argv) > 2:
    os.environ["RAY_AUTH_TOKEN"] = sys.argv[2]
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", namespace=None, timeout=10)
    print("let in")
except Exception as e:
    print("refused:", type(e).__name__, e)
"""


def tree(proc: "psutil.Process") -> list:
    """`proc` and its descendants still alive (short-lived helpers that Ray starts and reaps come and go
    while the tree is listed)."""
    return [p for p in [proc, *proc.children(recursive=True)] if name_of(p)]


def name_of(p: "psutil.Process") -> str:
    """The process's name, or "" once it has exited."""
    try:
        return p.name()
    except psutil.NoSuchProcess:
        return ""


def alive(p: "psutil.Process") -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def listening(procs) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket and bound UDP socket of `procs`."""
    pids = {p.pid: p for p in procs}
    out = []
    for c in psutil.net_connections("inet"):
        if c.pid in pids and c.laddr and (c.status == psutil.CONN_LISTEN or c.type == 2):  # 2: SOCK_DGRAM
            out.append((name_of(pids[c.pid]), c.laddr.ip, c.laddr.port))
    return out


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def wait_for(what, predicate, timeout=180.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def gcs(procs):
    return next((p for p in procs if name_of(p) == "gcs_server"), None)


def test_a_local_ray_run_listens_on_loopback_asks_for_its_token_and_dies_with_its_driver(tmp_path):
    run_dir = tmp_path / "run"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tempering.cli",
            "train",
            "configs/smoke.yaml",
            f"run.dir={run_dir}",
            "sft.steps=4",
            "train.steps=200",
            "distributed.backend=ray",
            "rollout.workers=2",
            "rollout.worker_cpus=0.5",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        parent = psutil.Process(driver.pid)
        # the run is under way once a row is written: the pool, its workers and sandbox actors all started
        wait_for(
            "the first RL row",
            lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip(),
        )
        procs = tree(parent)
        names = {name_of(p) for p in procs}
        assert {"gcs_server", "raylet"} <= names and sum(
            n.startswith("ray::RolloutWorker") for n in names
        ) >= 1
        sockets = listening(procs)
        assert len(sockets) >= 6, sockets  # GCS, raylet (2), agents, each worker's and the driver's servers
        exposed = [s for s in sockets if not loopback(s[1])]
        assert not exposed, f"listening beyond loopback: {exposed}"

        head = gcs(procs)
        port = next(s[2] for s in sockets if s[0] == "gcs_server")
        token = head.environ().get("RAY_AUTH_TOKEN")
        assert token, "the cluster runs without a token"
        probe = [sys.executable, "-c", GCS_PROBE, f"127.0.0.1:{port}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        stranger = subprocess.run(probe, capture_output=True, text=True, timeout=60, env=env)
        assert "refused: AuthenticationError" in stranger.stdout, stranger.stdout + stranger.stderr[-2000:]
        wrong = subprocess.run(
            [*probe, "0" * len(token)], capture_output=True, text=True, timeout=60, env=env
        )
        assert "refused: AuthenticationError" in wrong.stdout, wrong.stdout + wrong.stderr[-2000:]
        friend = subprocess.run([*probe, token], capture_output=True, text=True, timeout=60, env=env)
        assert "let in" in friend.stdout, friend.stdout + friend.stderr[-2000:]

        procs = [p for p in tree(parent) if p.pid != driver.pid]
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)

        def gone():
            return not any(alive(p) for p in procs) or None

        try:
            wait_for("the cluster to die with its driver", gone, timeout=15)
        except AssertionError:
            left = [(p.pid, name_of(p)) for p in procs if alive(p)]
            raise AssertionError(
                f"still running 15 s after the driver's kill -9: {left}; listening: {listening(procs)}"
            ) from None
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
