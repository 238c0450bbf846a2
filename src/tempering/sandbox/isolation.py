"""How a sandbox worker is started: inside a bubblewrap container where possible, else as a plain process.

A worker is one long-lived fork server (`_worker.py`). Under bubblewrap it is PID 1 of fresh user, PID,
network, IPC, UTS and cgroup namespaces, with no capabilities, a read-only view of /usr (and nothing
else of the host's filesystem), a size-limited tmpfs for scratch, an empty environment, and it dies with
its parent. When the host runs as root the worker runs as its own unprivileged uid, so `RLIMIT_NPROC`
binds (it is per real uid and ignored for root) and host files readable only by root stay unreadable.
A pool may add read-only import paths (`python_path`, bound at the same path inside and put first on the
worker's sys.path) and modules the fork server imports once before it forks (`preload`): what a verifier
running in the sandbox needs, e.g. reasoning-gym's (`envs/gym.py`).

Measured on a 2-core VM (bench/sandbox_throughput.py): starting bubblewrap costs ~15-25 ms, paid once
per worker; each execution is a fork inside the container.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tempering.errors import SandboxError

WORKER_SCRIPT = Path(__file__).with_name("_worker.py")
WORKER_BOOT = ("import os; f = os.fdopen({fd}, 'rb'); source = f.read(); f.close(); "
               "exec(compile(source, 'tempering-sandbox-worker', 'exec'), {{'__name__': '__main__'}})")
BACKENDS = ("auto", "bwrap", "process")
# Worker uids when the host is root: each worker its own uid, so a fork bomb in one cannot starve another.
WORKER_UID_BASE, WORKER_UID_SPAN = 61000, 4000
_uid_counter = itertools.count()


@dataclass(frozen=True)
class Protection:
    name: str
    active: bool
    how: str


@dataclass(frozen=True)
class Isolation:
    """A resolved backend: what starts a worker, and which protections that gives."""

    backend: str                 # "bwrap" or "process"
    python: str
    scratch_mb: int = 64
    bwrap: str | None = None
    why_not_bwrap: str | None = None
    python_path: tuple[str, ...] = ()
    """Directories bound read-only (same path) into the container and put first on the worker's sys.path."""
    preload: tuple[str, ...] = ()
    """Modules the fork server imports once, before it forks any execution."""

    def worker_command(self, uid: int | None, boot_fd: int = 3) -> tuple[list[str], dict]:
        """argv and Popen keyword arguments for one worker; the worker's source is read from the inherited
        pipe `boot_fd` (`WORKER_BOOT`), so it need not be readable by the worker's uid or in the container."""
        boot = WORKER_BOOT.format(fd=boot_fd)
        run_as = {}
        if uid is not None:
            run_as = {"user": uid, "group": uid, "extra_groups": []}
        setup = [f"--setup={json.dumps({'path': self.python_path, 'preload': self.preload})}"] \
            if self.python_path or self.preload else []
        if self.backend == "bwrap":
            argv = [self.bwrap, *bwrap_args(self.scratch_mb, self.python_path), "--", self.python, "-s", "-B", "-c",
                    boot, "/tmp", *setup]
            return argv, run_as
        return [self.python, "-s", "-B", "-c", boot, *setup], run_as

    def protections(self, uid: int | None) -> list[Protection]:
        bw = self.backend == "bwrap"
        root = os.geteuid() == 0
        off = f"off: {self.why_not_bwrap or 'bubblewrap not used'}"
        return [
            Protection("network isolation", bw, "new network namespace (no interfaces but its own loopback)"
                       if bw else off),
            Protection("filesystem isolation", bw, "only /usr is visible, read-only; root and /dev read-only"
                       + (f"; {len(self.python_path)} import path(s) read-only" if self.python_path else "")
                       if bw else off + " (the program sees the host's filesystem with the worker's rights)"),
            Protection("private scratch, size-limited", bw,
                       f"tmpfs /tmp of {self.scratch_mb} MiB, wiped after each execution" if bw
                       else "scratch directory wiped after each execution; no size limit beyond RLIMIT_FSIZE"),
            Protection("pid namespace", bw, "worker is PID 1: a program cannot signal it or see host processes"
                       if bw else off),
            Protection("no capabilities", bw or not root, "all dropped" if bw else
                       ("runs as a non-root uid" if uid is not None else "the worker runs as root")),
            Protection("unprivileged uid", uid is not None or not root,
                       f"uid {uid}" if uid is not None else f"uid {os.geteuid()}"),
            Protection("process limit (RLIMIT_NPROC)", uid is not None or not root,
                       "per-worker uid" if uid is not None else "not enforced for root"),
            Protection("rlimits: CPU, address space, file size, open files", True, "set in every child"),
            Protection("process-tree kill", True, "process group killed, then every leftover process "
                       + ("in the namespace" if bw else "reparented to the worker (child subreaper)")),
            Protection("empty environment", True, "worker started with no variables"),
            Protection("dies with its parent", bw, "--die-with-parent" if bw else
                       "worker exits when its pipe closes; a running program is killed then"),
            Protection("tests out of the program's reach", True,
                       "expected values stay in the host; check() code runs in a separate process"),
        ]


def bwrap_args(scratch_mb: int, ro_paths: tuple[str, ...] = ()) -> list[str]:
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for etc in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        args += ["--ro-bind-try", etc, etc]
    for path in ro_paths:  # e.g. a venv's site-packages, for a preloaded verifier
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(scratch_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
             "--remount-ro", "/", "--chdir", "/tmp"]
    return args


def next_worker_uid() -> int | None:
    """A dedicated uid for a new worker when running as root; None (keep ours) otherwise."""
    if os.geteuid() != 0:
        return None
    return WORKER_UID_BASE + (os.getpid() * 16 + next(_uid_counter)) % WORKER_UID_SPAN


@functools.lru_cache(maxsize=8)
def _bwrap_works(bwrap: str, python: str) -> str | None:
    """None if a trivial bubblewrap container starts here, else why not."""
    iso = Isolation("bwrap", python, bwrap=bwrap)
    argv = [bwrap, *bwrap_args(8), "--", python, "-c", "pass"]
    uid = WORKER_UID_BASE + WORKER_UID_SPAN if os.geteuid() == 0 else None
    kwargs = iso.worker_command(uid)[1]
    try:
        proc = subprocess.run(argv, env={}, capture_output=True, timeout=20, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap failed to start ({e})"
    if proc.returncode != 0:
        return f"bubblewrap cannot create namespaces here: {proc.stderr.decode(errors='replace').strip()[:300]}"
    return None


def resolve(backend: str, python: str, scratch_mb: int = 64) -> Isolation:
    """Pick the backend: `bwrap` (required), `process`, or `auto` (bwrap when it works here)."""
    if backend not in BACKENDS:
        raise SandboxError(f"sandbox.isolation must be one of {', '.join(BACKENDS)}, not '{backend}'")
    if backend == "process":
        return Isolation("process", python, scratch_mb, why_not_bwrap="sandbox.isolation=process")
    bwrap = shutil.which("bwrap")
    why = "bubblewrap (bwrap) is not installed" if bwrap is None else _bwrap_works(bwrap, python)
    if why is None:
        return Isolation("bwrap", python, scratch_mb, bwrap=bwrap)
    if backend == "bwrap":
        raise SandboxError(f"sandbox.isolation=bwrap but {why}; install bubblewrap (apt-get install bubblewrap) "
                           "or set sandbox.isolation=auto to fall back to process isolation")
    return Isolation("process", python, scratch_mb, why_not_bwrap=why)
