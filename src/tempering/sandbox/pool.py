"""Host side of the sandbox: the `Sandbox` interface and `LocalSandbox`, a pool of warm fork-server workers.

A worker (`_worker.py`) is started once - inside a bubblewrap container where available, see
`isolation.py` - and then forks a fresh, limited child per execution, so neither the interpreter's
start-up nor the container's is paid per execution. Test verdicts are decided by the caller (`grading.py`).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import signal
import struct
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from tempering.errors import SandboxError
from tempering.sandbox.execution import LANGUAGES, ExecRequest, SandboxLimits, limits_problem, to_result
from tempering.sandbox.grading import grade, test_requests
from tempering.sandbox.isolation import WORKER_SCRIPT, Isolation, Protection, resolve
from tempering.sandbox.uids import kill_uids, lease_worker_ids, pair
from tempering.types import ExecResult, Task

# How much longer than the execution's own timeout and compile timeout the host waits for a worker before
# declaring it hung.
WORKER_GRACE_S = 5.0
WORKER_START_TIMEOUT_S = 20.0
PRELOAD_START_TIMEOUT_S = 120.0  # a worker that preloads a large package (reasoning-gym: ~3 s idle)
WORKER_SOURCE = WORKER_SCRIPT.read_bytes()


def default_python() -> str:
    """The system interpreter where there is one (fast start, readable by any uid), else the current one."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    import sys

    return sys.executable


# ------------------------------------------------------------------------------------------ workers


class WorkerDied(SandboxError):
    """The worker process ended (or was stopped) during an execution: a program in a worker that shares
    its uid with the program reached it."""


class _Worker:
    """One fork-server process and its pipes."""

    def __init__(self, isolation: Isolation):
        self.ids = lease_worker_ids()
        self.broken = False
        self.sent = 0  # the id of the last request sent
        self.errors = tempfile.TemporaryFile()
        boot_r, boot_w = os.pipe()  # the worker's source (see isolation.WORKER_BOOT)
        try:
            self.proc = isolation.start(
                self.ids, isolation.worker_argv(boot_r), stderr=self.errors, pass_fds=(boot_r,)
            )
        except OSError as e:
            os.close(boot_w)
            self.errors.close()
            if self.ids is not None:
                self.ids.release()
            raise SandboxError(f"cannot start a sandbox worker: {e}") from None
        finally:
            os.close(boot_r)
        try:
            with os.fdopen(boot_w, "wb") as f:
                f.write(WORKER_SOURCE)
        except BrokenPipeError:
            pass  # the worker died at once; _receive below reports it with its stderr
        try:
            wait = PRELOAD_START_TIMEOUT_S if isolation.preload else WORKER_START_TIMEOUT_S
            self.info = self._receive(time.monotonic() + wait)
        except SandboxError as e:
            self.errors.seek(0)
            detail = self.errors.read().decode(errors="replace").strip()[-500:]
            self.close()
            raise SandboxError(
                f"sandbox worker failed to start: {e}" + (f": {detail}" if detail else "")
            ) from None

    def request(
        self, payload: dict[str, Any], timeout_s: float, secret: dict | None = None
    ) -> dict[str, Any]:
        """The worker's answer to `payload`. Each request carries a new id that the worker echoes: an answer
        with any other id (one left in the pipe by an earlier request) is never taken for this one's."""
        self.sent += 1
        data = _frame({**payload, "id": self.sent}) + (_frame(secret) if secret is not None else b"")
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(f"sandbox worker is gone ({e})") from None
        resp = self._receive(time.monotonic() + timeout_s)
        if resp.get("id") != self.sent:
            raise SandboxError(
                f"sandbox worker answered request {resp.get('id')!r} when asked request {self.sent}"
            )
        del resp["id"]
        return resp

    def _receive(self, deadline: float) -> dict[str, Any]:
        (n,) = struct.unpack(">I", self._read(4, deadline))
        return json.loads(self._read(n, deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        data = bytearray()
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxError("sandbox worker did not answer in time")
            if not select.select([fd], [], [], min(left, 0.5))[0]:
                if _stopped(self.proc.pid):  # SIGSTOP from a program sharing the worker's uid
                    raise WorkerDied("sandbox worker was stopped by a signal")
                continue
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise WorkerDied(f"sandbox worker exited (code {self.proc.wait()})")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        """Stop the worker: politely when it is healthy (it exits when its pipe closes), else by force, with
        every process still running under its uids (an execution's, which has a session of its own)."""
        if self.proc.poll() is None:
            try:
                if self.broken:
                    raise OSError("broken")
                self.proc.stdin.close()
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if self.ids is not None:
            if self.broken:
                kill_uids({self.ids.server, self.ids.program})
            self.ids.release()  # only now: the pair's processes are gone
        self.errors.close()


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


class Sandbox:
    """What every sandbox offers (local pool or remote service); subclasses implement `execute_many`."""

    limits: SandboxLimits

    def execute_many(
        self, requests: list[ExecRequest], *, concurrency: int | None = None
    ) -> list[dict[str, Any]]:
        """Raw worker responses (see `_worker.collect`), in the order of `requests`."""
        raise NotImplementedError

    def request(
        self, code: str, *, timeout_s: float | None = None, memory_mb: int | None = None, **kw: Any
    ) -> ExecRequest:
        """An ExecRequest with this sandbox's limits, optionally with another timeout / memory limit."""
        limits = self.limits
        if timeout_s is not None:
            limits = replace(limits, timeout_s=timeout_s, cpu_s=min(limits.cpu_s, timeout_s))
        if memory_mb is not None:
            limits = replace(limits, memory_mb=memory_mb)
        return ExecRequest(code=code, limits=limits, **kw)

    def run(
        self,
        code: str,
        *,
        language: str = "python",
        stdin: str | None = None,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
    ) -> ExecResult:
        """Execute one program and return what it did."""
        req = self.request(code, language=language, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        return self.run_batch([req])[0]

    def run_batch(self, requests: list[ExecRequest], *, concurrency: int | None = None) -> list[ExecResult]:
        """Execute requests in parallel (at most `concurrency`); results in order."""
        return [to_result(r) for r in self.execute_many(requests, concurrency=concurrency)]

    def run_tests(self, task: Task, code: str) -> ExecResult:
        """Execute `code` against the task's hidden tests."""
        return self.run_tests_batch([(task, code)])[0]

    def run_tests_batch(
        self, items: list[tuple[Task, str]], *, concurrency: int | None = None
    ) -> list[ExecResult]:
        """Run each program against its task's hidden tests; per-test verdicts are decided here, in the
        caller's process: expected outputs are never sent to a worker (or to a remote service)."""
        jobs: list[ExecRequest] = []
        spans: list[tuple[int, int]] = []
        for task, code in items:
            reqs = test_requests(task, code, self.limits)
            spans.append((len(jobs), len(jobs) + len(reqs)))
            jobs += reqs
        raw = self.execute_many(jobs, concurrency=concurrency)
        return [grade(task, raw[a:b]) for (task, _), (a, b) in zip(items, spans)]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSandbox(Sandbox):
    """A pool of `workers` fork-server processes on this machine.

    Thread-safe; `execute_many` keeps every worker busy. At most `workers` executions run at once; the
    rest of a batch waits in the caller (`run_batch` returns when all are done), which is the
    backpressure: a caller submitting faster than the workers execute simply blocks.

    A worker that died, was damaged by its program (`worker_damaged`), hung, or answered `sandbox_error`
    is never used again: it is closed and a fresh one started before the next execution on that slot.
    Workers are started by one long-lived thread, because a worker dies with the thread that started it
    (the parent-death signal follows the thread, not the process).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        workers: int = 2,
        python: str | None = None,
        isolation: str = "auto",
        scratch_mb: int = 64,
        scratch_inodes: int = 8192,
        python_path: tuple[str, ...] = (),
        preload: tuple[str, ...] = (),
    ):
        """`python_path`: directories bound read-only into each worker and put first on its sys.path;
        `preload`: modules each worker imports once before forking executions (see `_worker.prepare`)."""
        self.limits = limits or SandboxLimits()
        self.python = python or default_python()
        if not os.access(self.python, os.X_OK):
            raise SandboxError(f"sandbox interpreter '{self.python}' not found")
        self.isolation = replace(
            resolve(isolation, self.python, scratch_mb, scratch_inodes),
            python_path=tuple(python_path),
            preload=tuple(preload),
        )
        for path in python_path:
            if not (os.path.isabs(path) and os.path.isdir(path)):
                raise SandboxError(f"sandbox import path '{path}' is not an absolute path to a directory")
        self.size = max(1, workers)
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        started: list[_Worker] = []
        try:
            for _ in range(self.size):
                started.append(self._start_worker())
        except SandboxError:
            for w in started:
                w.close()
            self._spawner.shutdown()
            raise
        for w in started:
            self._idle.put(w)
        self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="sandbox")
        self._lock = threading.Lock()
        self._closed = False
        self.replaced = 0
        """Workers replaced so far (died, damaged, hung or answered sandbox_error)."""
        atexit.register(self.close)

    @property
    def backend(self) -> str:
        return self.isolation.backend

    def protections(self) -> list[Protection]:
        """What this sandbox's workers are protected by (see `tempering sandbox doctor`)."""
        worker = next(iter(self._idle.queue), None)
        if worker is None:
            return self.isolation.protections(pair(0) if os.geteuid() == 0 else None)
        return self.isolation.protections(worker.ids, worker.info)

    def _start_worker(self) -> _Worker:
        return self._spawner.submit(_Worker, self.isolation).result()

    # --------------------------------------------------------------------------------- execution

    def execute(self, req: ExecRequest) -> dict[str, Any]:
        """Run one request on an idle worker; the raw worker response (see `_worker.collect`)."""
        if req.language not in LANGUAGES:
            raise SandboxError(
                f"language '{req.language}' is not supported; use one of {', '.join(LANGUAGES)}"
            )
        if req.kind != "program" and req.language != "python":
            raise SandboxError(f"function-call and check() tests need language python, not '{req.language}'")
        lim = req.limits
        payload = {
            "kind": req.kind,
            "code": req.code,
            "language": req.language,
            "stdin": req.stdin,
            "entry_point": req.entry_point,
            "calls": req.calls,
            "n_tests": len(req.checks) if req.checks is not None else None,
            "timeout_s": lim.timeout_s,
            "cpu_s": lim.cpu_s,
            "memory_mb": lim.memory_mb,
            "max_output_bytes": lim.max_output_bytes,
            "max_file_bytes": lim.max_file_bytes,
            "max_processes": lim.max_processes,
            "compile_timeout_s": lim.compile_timeout_s,
        }
        secret = {"tests": req.checks} if req.checks is not None else None
        if why := limits_problem(lim):
            raise SandboxError(why)
        worker = self._idle.get()
        try:
            if worker.broken:
                worker.close()
                worker = (
                    self._start_worker()
                )  # raises SandboxError if no worker can start: not the program's fault
                self.replaced += 1
            resp = worker.request(payload, lim.timeout_s + lim.compile_timeout_s + WORKER_GRACE_S, secret)
        except WorkerDied as e:
            worker.broken = True
            return {
                "status": "killed",
                "stderr": f"{e}: the execution ended its sandbox worker, which is replaced",
                "flags": ["worker_tampered"],
            }
        except SandboxError as e:
            worker.broken = True
            return {"status": "sandbox_error", "stderr": str(e)}
        except BaseException:
            worker.broken = (
                True  # its answer may still arrive: no later request may read it (or wait behind it)
            )
            raise
        finally:
            self._idle.put(worker)
        if resp.get("worker_damaged"):
            # Possible only where program and server share a uid: the program is to blame, not the sandbox.
            worker.broken = True
            note = f"\nthe program damaged its sandbox worker ({resp['worker_damaged']}); the worker is replaced\n"
            resp.update(
                status="killed",
                stderr=(resp.get("stderr") or "") + note,
                flags=sorted({*resp.get("flags", []), "worker_tampered"}),
            )
        elif resp.get("status") == "sandbox_error":
            worker.broken = True
        return resp

    def _map(self, fn, items: list, concurrency: int | None) -> list:
        if self._closed:
            raise SandboxError("sandbox is closed")
        if len(items) <= 1 or (concurrency or self.size) == 1:
            return [fn(x) for x in items]
        if concurrency and concurrency < self.size:
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                return list(pool.map(fn, items))
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        while not self._idle.empty():
            self._idle.get().close()
        self._spawner.shutdown()

    def execute_many(
        self, requests: list[ExecRequest], *, concurrency: int | None = None
    ) -> list[dict[str, Any]]:
        return self._map(self.execute, requests, concurrency)
