"""Ends a local Ray cluster's processes once the driver that started it is gone, `kill -9` included.

Ray's GCS and raylet die with their driver, but its dashboard and runtime-env agents retry the dead GCS for
about a minute first (still listening), and workers can outlive a raylet by seconds. So the driver gives the
cluster a directory of its own (Ray's `_temp_dir`: sessions, logs, sockets) and starts this watcher beside
it. Every process of the cluster keeps files open under that directory (its logs), which is how the watcher
knows them: an environment marker was tried first, and Ray's agents overwrite their environment when they
set their process titles. The watcher waits until its stdin closes (the driver closed the pool, or died:
the kernel closes a dead process's pipes) or its parent changes, kills every process with a file open under
the directory, and removes the directory.

Standard library only, no tempering import, run as a script: it starts in a fraction of a second and
depends on nothing of the driver's state.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile


class Watcher:
    """A cluster's directory (`root`, for `ray.init(_temp_dir=...)`) and the process that watches its driver."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="tempering-ray-")
        self.process = subprocess.Popen(
            [sys.executable, "-S", __file__, self.root, str(os.getpid())],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )  # the driver's Ctrl-C reaches Ray, not this

    def close(self) -> None:
        """Kill what is left of the cluster (after `ray.shutdown`, normally nothing) and end the watcher."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def members(root: str, spare: tuple[int, ...] = ()) -> list[int]:
    """The processes with a file open under `root`, other than this one and `spare`."""
    prefix, found, spare = root.rstrip("/") + "/", [], (os.getpid(), *spare)
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in spare:
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefix) for fd in fds):
                found.append(int(name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def reap(root: str, driver: int) -> int:
    """Kill the cluster's processes (never the driver, which keeps its own Ray logs open there) and remove the
    directory; how many processes there were."""
    pids = members(root, spare=(driver,))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    shutil.rmtree(root, ignore_errors=True)
    return len(pids)


def _watch(root: str, driver: int) -> None:
    while os.getppid() == driver:
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    reap(root, driver)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch(sys.argv[1], int(sys.argv[2]))
