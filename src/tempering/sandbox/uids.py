"""Host uids for sandbox workers, unique on the host: each worker of every process gets a pair of its own.

Where the host is root, each worker runs as a pair of host uids (server, program; see `isolation.py`).
The pair must be used by no other worker on the host - not only in this process: cleaning up a broken
worker SIGKILLs every process of its uids, and RLIMIT_NPROC counts every process of the program uid, so a
pair shared with another process's worker would kill, or starve, that worker.

A pair is leased with an exclusive `flock` on its lock file (`LOCK_DIR/pair-N.lock`, root-only), held for
the worker's life. The kernel drops the lock when its holder exits, however it exits, so a crashed
process leaves no stale lease behind. A pair whose uids still own processes (left by a holder that died
while a program ran) is skipped as well, so a fresh lease never starts beside leftovers.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from tempering.errors import SandboxError

WORKER_UID_BASE, WORKER_UID_SPAN = 61000, 4000
PAIRS = WORKER_UID_SPAN // 2
LOCK_DIRS = (Path("/run/tempering/sandbox-uids"), Path("/tmp/tempering-sandbox-uids"))
"""Where the leases live: the first that can be created (root-only, mode 0700); every process on the
host picks the same one."""


@dataclass(frozen=True)
class WorkerIds:
    """Host uids (equal to the gids) of one worker, and the lease that keeps them its own."""

    server: int
    program: int
    lock_fd: int | None = field(default=None, compare=False, repr=False)

    def release(self) -> None:
        """Give the pair back (closing the lock file drops the lock)."""
        if self.lock_fd is not None:
            try:
                os.close(self.lock_fd)
            except OSError:
                pass


def pair(n: int) -> WorkerIds:
    """The n-th pair of host uids, without a lease (for describing one)."""
    return WorkerIds(WORKER_UID_BASE + 2 * n, WORKER_UID_BASE + 2 * n + 1)


def lock_dir() -> Path:
    for path in LOCK_DIRS:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise SandboxError(
        f"cannot create a directory for sandbox uid leases (tried {', '.join(map(str, LOCK_DIRS))})"
    )


def lease_worker_ids() -> WorkerIds | None:
    """A pair of host uids that no other worker on this host holds, leased until `release()` (or until
    this process exits); None when the host is not root (workers then keep our uid)."""
    if os.geteuid() != 0:
        return None
    directory = lock_dir()
    busy = uids_in_use()
    start = random.SystemRandom().randrange(PAIRS)  # spread the first tries of processes starting together
    for k in range(PAIRS):
        n = (start + k) % PAIRS
        ids = pair(n)
        if ids.server in busy or ids.program in busy:
            continue
        fd = os.open(directory / f"pair-{n}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if processes_of({ids.server, ids.program}):  # appeared between the scan and the lock
            os.close(fd)
            continue
        return WorkerIds(ids.server, ids.program, fd)
    raise SandboxError(
        f"all {PAIRS} pairs of sandbox uids ({WORKER_UID_BASE}-{WORKER_UID_BASE + WORKER_UID_SPAN - 1}) "
        "are in use on this host"
    )


def _proc_uids():
    """(pid, real uid) of every live, non-zombie process."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            uid, state = int(fields[b"Uid"].split()[0]), fields[b"State"].split()[0]
        except (OSError, KeyError, ValueError, IndexError):
            continue
        if state != b"Z":
            yield int(name), uid


def uids_in_use() -> set[int]:
    return {uid for _, uid in _proc_uids()}


def processes_of(uids: set[int]) -> list[int]:
    return [pid for pid, uid in _proc_uids() if uid in uids]


def kill_uids(uids: set[int]) -> None:
    """SIGKILL every process whose real uid is in `uids` (a worker's own leased uids, used by nothing else)."""
    for _ in range(20):
        pids = processes_of(uids)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
