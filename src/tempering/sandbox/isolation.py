"""How a sandbox worker is started: inside a bubblewrap container where possible, else as a plain process.

A worker is one long-lived fork server (`_worker.py`). Under bubblewrap it is PID 1 of fresh PID, network,
IPC, UTS and cgroup namespaces, with a read-only view of /usr (and nothing else of the host's
filesystem), a size- and inode-limited tmpfs for scratch, and it dies with its parent. A pool may add
read-only import paths (`python_path`, bound read-only at `IMPORTS/<i>` inside - not at their own path,
which may lie under /tmp, where each worker mounts its scratch area - and put first on the worker's
sys.path) and modules the fork server imports once before it forks (`preload`): what a verifier running
in the sandbox needs, e.g. reasoning-gym's (`envs/gym.py`).

Two uids per worker (`uid_split`, where the host is root and user namespaces work): the launcher
(`_launch.py`) enters a user namespace in which uid 0 is the worker's *server* uid on the host and uid 1
its *program* uid. The fork server keeps only `SERVER_CAPS`, valid inside that namespace (so over those
two uids only); each forked child switches to the program uid, which drops every capability. A program
therefore cannot signal, ptrace or `prlimit` its server, nor its checker. Without root a two-uid map is
impossible: worker and programs share one uid (a bubblewrap worker is still PID 1, which signals from
inside cannot reach); the server then checks its own rlimits after each execution and the host replaces
a damaged worker (see `pool.py`). `tempering sandbox doctor` prints what is active.

Measured on a 2-core VM: starting and closing a pool of one worker takes ~0.2 s with either backend (the
launcher is one more interpreter start), paid once per worker; each execution is a fork inside it.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tempering.errors import SandboxError
from tempering.sandbox.uids import WorkerIds, lease_worker_ids

WORKER_SCRIPT = Path(__file__).with_name("_worker.py")
LAUNCH_SOURCE = Path(__file__).with_name("_launch.py").read_text()
WORKER_BOOT = (
    "import os; f = os.fdopen({fd}, 'rb'); source = f.read(); f.close(); "
    "exec(compile(source, 'tempering-sandbox-worker', 'exec'), {{'__name__': '__main__'}})"
)
BACKENDS = ("auto", "bwrap", "process")
# Host uids when the host is root: each worker a pair (server, program) leased host-wide (`uids.py`), so
# a fork bomb in one worker cannot starve another and no program shares a uid with any server.
PROGRAM_ID = 1  # the program's uid and gid inside a split worker's user namespace (the server is 0)
# What the fork server keeps, inside its user namespace: switching a child to the program uid, killing
# what an execution left behind, and creating / wiping the program's scratch directory.
SERVER_CAPS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
}
# Every worker runs with a fixed hash seed: set iteration order (and so a program's output) is the same
# on every worker of every backend, and across resumed runs.
WORKER_ENV = {"PYTHONHASHSEED": "0"}
SCRATCH = "/tmp"  # where the scratch tmpfs is mounted, in the worker's mount namespace
IMPORTS = (
    "/run/tempering-imports"  # where a contained worker sees its import paths (IMPORTS/0, IMPORTS/1, ...)
)
HANDSHAKE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Protection:
    name: str
    active: bool
    how: str


@dataclass(frozen=True)
class Isolation:
    """A resolved backend: what starts a worker, and which protections that gives."""

    backend: str  # "bwrap" or "process"
    python: str
    scratch_mb: int = 64
    scratch_inodes: int = 8192
    bwrap: str | None = None
    why_not_bwrap: str | None = None
    uid_split: bool = False  # programs run under a uid other than their server's (see module doc)
    why_not_split: str | None = None
    python_path: tuple[str, ...] = ()
    """Directories bound read-only (same path) into the container and put first on the worker's sys.path."""
    preload: tuple[str, ...] = ()
    """Modules the fork server imports once, before it forks any execution."""

    def import_views(self) -> list[str]:
        """Where the worker sees each of `python_path`: the path itself for a plain process; IMPORTS/<i>
        when its /tmp is its own scratch (bubblewrap or the two-uid launcher), which would hide a path
        under /tmp (a checkout or virtual environment in the temporary directory)."""
        contained = self.uid_split or self.backend == "bwrap"
        return [f"{IMPORTS}/{i}" if contained else path for i, path in enumerate(self.python_path)]

    def worker_config(self) -> dict:
        """What the fork server is told on its command line (`_worker.main`)."""
        return {
            "scratch": SCRATCH if self.uid_split or self.backend == "bwrap" else None,  # None: a temp dir
            "program_id": PROGRAM_ID if self.uid_split else None,
            "path": self.import_views(),
            "preload": list(self.preload),
        }

    def worker_argv(self, boot_fd: int) -> list[str]:
        """The fork server's own command line; its source comes on the inherited pipe `boot_fd`
        (`WORKER_BOOT`), so it need not be readable by the worker's uid or present in the container."""
        return [
            self.python,
            "-s",
            "-B",
            "-c",
            WORKER_BOOT.format(fd=boot_fd),
            json.dumps(self.worker_config()),
        ]

    def command(self, ids: WorkerIds | None, inner: list[str]) -> tuple[list[str], dict]:
        """argv and Popen keyword arguments that run `inner` as a worker with the uids `ids`."""
        bw = self.backend == "bwrap"
        views = self.import_views()
        if bw:  # a split worker's launcher has bound the import paths at their views already: bind those
            binds = list(zip(views if self.uid_split else self.python_path, views))
            inner = [self.bwrap, *bwrap_args(self.scratch_mb, binds, split=self.uid_split), "--", *inner]
        if self.uid_split:  # started as root: the launcher maps the uids, see _launch.py
            os.makedirs(
                IMPORTS, mode=0o755, exist_ok=True
            )  # the launcher's mount point (in its own namespace)
            config = {
                "scratch": SCRATCH,
                "scratch_mb": self.scratch_mb,
                "scratch_inodes": self.scratch_inodes,
                "argv": inner,
                "env": WORKER_ENV,
                "die_with_parent": not bw,
                "bounding_caps": None if bw else sorted(SERVER_CAPS.values()),
                "imports_root": IMPORTS,
                "imports": [list(b) for b in zip(self.python_path, views)],
            }
            return [self.python, "-s", "-B", "-c", LAUNCH_SOURCE, json.dumps(config)], {}
        run_as = {"user": ids.server, "group": ids.server, "extra_groups": []} if ids is not None else {}
        return inner, run_as

    def start(self, ids: WorkerIds | None, inner: list[str], *, stderr, pass_fds=()) -> subprocess.Popen:
        """Start `inner` as a worker with pipes on stdin/stdout; a split worker's uids are mapped first."""
        argv, run_as = self.command(ids, inner)
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=WORKER_ENV,
            cwd="/",
            start_new_session=True,
            pass_fds=pass_fds,
            **run_as,
        )
        if self.uid_split:
            try:
                ready = select.select([proc.stdout], [], [], HANDSHAKE_TIMEOUT_S)[0]
                if not ready or os.read(proc.stdout.fileno(), 1) != b"U":
                    raise OSError("the launcher did not enter its user namespace")
                map_ids(proc.pid, ids)
                proc.stdin.write(b"G")
                proc.stdin.flush()
            except OSError as e:
                proc.kill()
                proc.wait()
                raise OSError(f"cannot give the worker its two uids ({e})") from None
        return proc

    def protections(self, ids: WorkerIds | None, info: dict | None = None) -> list[Protection]:
        """What confines a program here (`tempering sandbox doctor` prints it): its namespaces, its uid and
        privileges, and what holds on every backend. `info`: what a worker reported (`max_user_namespaces`)."""
        return [*self._namespaces(ids, info or {}), *self._privileges(ids), *self._always()]

    def _scratch(self) -> str:
        if self.uid_split:
            return (
                f"tmpfs of {self.scratch_mb} MiB and {self.scratch_inodes} inodes, wiped after each execution"
            )
        if self.backend == "bwrap":
            return (
                f"tmpfs of {self.scratch_mb} MiB, wiped after each execution; NO inode cap "
                f"({self.why_not_split or 'bubblewrap --tmpfs has a size option only'})"
            )
        return "scratch directory wiped after each execution; no size or inode limit beyond RLIMIT_FSIZE"

    def _namespaces(self, ids: WorkerIds | None, info: dict) -> list[Protection]:
        bw, split, root = self.backend == "bwrap", self.uid_split, os.geteuid() == 0
        off = f"off: {self.why_not_bwrap or 'bubblewrap not used'}"
        nested = info.get("max_user_namespaces")
        return [
            Protection(
                "network isolation",
                bw,
                "new network namespace (no interfaces but its own loopback)" if bw else off,
            ),
            Protection(
                "filesystem isolation",
                bw,
                "only /usr is visible, read-only; root and /dev read-only"
                + (f"; {len(self.python_path)} import path(s) read-only" if self.python_path else "")
                if bw
                else off + " (the program sees the host's filesystem with its uid's rights)",
            ),
            Protection("scratch size and inode cap", split, self._scratch()),
            Protection(
                "program uid != server uid",
                split,
                f"programs run as host uid {ids.program}, their fork server as {ids.server}: a program "
                "cannot signal, ptrace or prlimit it"
                if split and ids
                else f"off: {self.why_not_split}; a program shares its server's uid (damage to the server is "
                "detected after each execution and the worker replaced)"
                + (
                    ""
                    if bw or root
                    else ", and every process of this user on the host, which it can "
                    "signal and prlimit: use bubblewrap"
                ),
            ),
            Protection(
                "server privileges bounded",
                split,
                f"the server keeps only {', '.join(SERVER_CAPS)}, valid in its user namespace of two "
                "uids; each program drops all (no_new_privs)"
                if split
                else "off: the server has no capabilities to bound (a single uid)",
            ),
            Protection(
                "pid namespace",
                bw,
                "worker is PID 1: a program cannot see host processes, nor signal it" if bw else off,
            ),
            Protection(
                "no nested user namespaces",
                nested == 0,
                "max_user_namespaces=0 in the worker's namespace: no private tmpfs outside the caps"
                if nested == 0
                else "off: a program may create user namespaces (and tmpfs mounts there)",
            ),
        ]

    def _privileges(self, ids: WorkerIds | None) -> list[Protection]:
        bw, split, root = self.backend == "bwrap", self.uid_split, os.geteuid() == 0
        return [
            Protection(
                "no capabilities",
                bw or split or not root,
                "programs have none (no_new_privs)"
                if bw or split
                else ("runs as a non-root uid" if ids is not None else "the worker runs as root"),
            ),
            Protection(
                "unprivileged uid",
                ids is not None or not root,
                f"uid {ids.program}" if ids is not None else f"uid {os.geteuid()}",
            ),
            Protection(
                "process limit (RLIMIT_NPROC)",
                ids is not None or not root,
                "per-worker program uid"
                if ids is not None
                else f"counts every process of uid {os.geteuid()}, the host user's own included"
                if not root
                else "not enforced for root",
            ),
        ]

    def _always(self) -> list[Protection]:
        bw, split = self.backend == "bwrap", self.uid_split
        return [
            Protection("rlimits: CPU, address space, file size, open files", True, "set in every child"),
            Protection(
                "process-tree kill",
                True,
                "process group killed, then every leftover process "
                + ("in the namespace" if bw else "reparented to the worker (child subreaper)"),
            ),
            Protection(
                "worker health check",
                True,
                "the server compares its own rlimits after each execution; "
                "a damaged worker, or one that returned sandbox_error, is replaced",
            ),
            Protection("deterministic hash seed", True, "PYTHONHASHSEED=0 in every worker"),
            Protection("empty environment", True, "programs start with no variables"),
            Protection(
                "dies with its parent",
                bw or split,
                "parent-death signal"
                if bw or split
                else "worker exits when its pipe closes; a running program is killed then",
            ),
            Protection(
                "tests out of the program's reach",
                True,
                "expected values stay in the host; check() code runs in a separate process",
            ),
        ]


def bwrap_args(scratch_mb: int, ro_binds: list[tuple[str, str]] = (), *, split: bool = False) -> list[str]:
    """bubblewrap's options. `split`: bwrap runs as root of the launcher's user namespace and must not make
    another one (which would map a single uid); the scratch tmpfs is the launcher's, bound in."""
    if split:
        args = [
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--cap-drop",
            "ALL",
        ]
        for cap in SERVER_CAPS:
            args += ["--cap-add", cap]
    else:
        args = ["--unshare-all", "--cap-drop", "ALL"]
    args += [
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    etc = ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime")
    # The directories bubblewrap creates on the way to a bind are 0700, closed to a program of another uid
    # than the server's (a lazy import from a read-only path would fail): create them 0755 first.
    dests = [dest for _, dest in ro_binds]
    parents = sorted({str(p) for path in (*etc, *dests) for p in Path(path).parents if str(p) != "/"})
    for parent in parents:
        args += ["--perms", "0755", "--dir", parent]
    for path in etc:
        args += ["--ro-bind-try", path, path]
    for source, dest in ro_binds:  # e.g. a venv's site-packages, for a preloaded verifier
        args += ["--ro-bind", source, dest]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    if split:
        args += ["--bind", SCRATCH, SCRATCH]
    else:
        args += ["--size", str(scratch_mb << 20), "--perms", "1777", "--tmpfs", SCRATCH]
    return args + ["--remount-ro", "/", "--chdir", SCRATCH]


def map_ids(pid: int, ids: WorkerIds) -> None:
    """Write a launcher's uid and gid maps: 0 -> the server's host id, 1 -> the program's (needs root)."""
    mapping = f"0 {ids.server} 1\n{PROGRAM_ID} {ids.program} 1\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(mapping)


def _trial(iso: Isolation) -> str | None:
    """None if a trivial worker of this kind starts here, else why not."""
    ids = lease_worker_ids()
    try:
        proc = iso.start(ids, [iso.python, "-c", "pass"], stderr=subprocess.PIPE)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return "a trial worker did not finish in 20 s"
    except OSError as e:
        return f"failed to start ({e})"
    finally:
        if ids is not None:
            ids.release()
    if proc.returncode != 0:
        return err.decode(errors="replace").strip()[:300] or f"exit code {proc.returncode}"
    return None


@functools.lru_cache(maxsize=8)
def _split_works(python: str) -> str | None:
    if os.geteuid() != 0:
        return "the host is not root (mapping a second uid needs CAP_SETUID)"
    why = _trial(Isolation("process", python, scratch_mb=8, scratch_inodes=64, uid_split=True))
    return None if why is None else f"no user namespace with two uids here: {why}"


@functools.lru_cache(maxsize=8)
def _bwrap_works(bwrap: str, python: str, split: bool) -> str | None:
    why = _trial(Isolation("bwrap", python, scratch_mb=8, scratch_inodes=64, bwrap=bwrap, uid_split=split))
    return None if why is None else f"bubblewrap cannot create namespaces here: {why}"


def resolve(backend: str, python: str, scratch_mb: int = 64, scratch_inodes: int = 8192) -> Isolation:
    """Pick the backend: `bwrap` (required), `process`, or `auto` (bwrap when it works here)."""
    if backend not in BACKENDS:
        raise SandboxError(f"sandbox.isolation must be one of {', '.join(BACKENDS)}, not '{backend}'")
    why_not_split = _split_works(python)
    split = why_not_split is None
    sizes = {
        "scratch_mb": scratch_mb,
        "scratch_inodes": scratch_inodes,
        "uid_split": split,
        "why_not_split": why_not_split,
    }
    if backend == "process":
        return Isolation("process", python, why_not_bwrap="sandbox.isolation=process", **sizes)
    bwrap = shutil.which("bwrap")
    why = "bubblewrap (bwrap) is not installed" if bwrap is None else _bwrap_works(bwrap, python, split)
    if why is None:
        return Isolation("bwrap", python, bwrap=bwrap, **sizes)
    if backend == "bwrap":
        raise SandboxError(
            f"sandbox.isolation=bwrap but {why}; install bubblewrap (apt-get install bubblewrap) "
            "or set sandbox.isolation=auto to fall back to process isolation"
        )
    return Isolation("process", python, why_not_bwrap=why, **sizes)
