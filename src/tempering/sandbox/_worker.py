"""Sandbox fork server: a long-lived process that forks a fresh, rlimited child per execution.

This file is run by any python3 (it imports nothing from tempering), usually as PID 1 of a bubblewrap
container (`isolation.py`). Protocol on fds 0/1: each message is a 4-byte big-endian length followed by
UTF-8 JSON. One request -> one response; a `check` request is followed by a second message holding the
test code, which is read only *after* the program's process has been forked, so it never exists in the
program's memory.

Per execution:
- the program runs in a forked child: own session, scratch directory, rlimits (CPU, address space,
  processes, file size, open files), empty environment, stdout/stderr to pipes read here up to a cap;
- `calls`: the child calls the entry point on each input and sends back only the repr of each returned
  plain value on fd 3; expected outputs never enter the sandbox, the host compares;
- `check`: HumanEval-style test code (`check(candidate)`) runs in a *second* child, the checker, that
  never runs untrusted code; its `candidate` is a proxy that sends the arguments to the program's child
  and parses the returned value as a literal. The verdicts come back on the checker's own pipe, which
  the program cannot reach;
- afterwards every process the execution left behind is killed (this server is PID 1 of its namespace,
  or a child subreaper) and the scratch area is wiped;
- where the worker has two uids (`program_id` in its argv config, see `isolation.py`), the program's child
  and the compiler switch to it, which drops every capability: nothing they do reaches this server or
  the checker. After each execution the server compares its own rlimits with those it started with and
  reports any change (`worker_damaged`): the host then replaces the worker.

With `path` and `preload` in its config, the server puts the paths first on sys.path and imports the
modules once before serving (`prepare`), so a verifier's package is loaded per worker, not per execution.
"""
# ruff: noqa: I001  (the second import block, preloaded for solutions, is grouped on purpose)

import ast
import builtins
import ctypes
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

# Modules a solution commonly imports: imported once here, so a forked child finds them loaded.
import bisect  # noqa: F401
import collections  # noqa: F401
import functools  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import math  # noqa: F401
import operator  # noqa: F401
import random  # noqa: F401
import re  # noqa: F401
import string  # noqa: F401
import typing  # noqa: F401

PLAIN_TYPES = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)
RESULT_CAP = 4 << 20
MB = 1 << 20
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 36, 38
RLIMITS = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")}
COMPILE_TIMEOUT_S = 20.0
COMPILE_MEMORY_MB = 2048

# How each language is run. Python runs inside the forked child (no exec: no interpreter start-up).
LANGUAGES = {
    "bash": {"file": "main.sh", "run": ["bash", "main.sh"]},
    "javascript": {"file": "main.js", "run": ["node", "main.js"]},
    "c": {
        "file": "main.c",
        "compile": ["gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"],
        "run": ["./main"],
    },
    "cpp": {
        "file": "main.cpp",
        "compile": ["g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp"],
        "run": ["./main"],
    },
}
# V8 reserves about 1 GiB of address space before running anything: its heap is capped instead.
NODE_RESERVE_MB = 1024


def read_msg(fd):
    header = _read_exact(fd, 4)
    if header is None:
        return None
    (n,) = struct.unpack(">I", header)
    body = _read_exact(fd, n)
    return None if body is None else json.loads(body.decode("utf-8"))


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def write_msg(fd, obj):
    body = json.dumps(obj).encode("utf-8")
    data = struct.pack(">I", len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def vm_size_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


try:
    LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:
    LIBC = None


def prctl(option, value):
    try:
        return LIBC.prctl(option, value, 0, 0, 0)
    except AttributeError:
        return -1


def become_program(program_id):
    """In a forked child: switch to the program's uid and gid (all capabilities go with the old uid) and
    forbid gaining any back through exec. Raises if the switch did not happen."""
    if program_id is not None:
        os.setgroups([])
        os.setresgid(program_id, program_id, program_id)
        os.setresuid(program_id, program_id, program_id)
        if os.getresuid() != (program_id,) * 3 or os.getresgid() != (program_id,) * 3:
            raise OSError("could not switch to the program uid")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities():
    """Give up every capability while keeping our uid (the checker: the server's uid, none of its powers)."""
    if LIBC is None or LIBC.capset(ctypes.byref(_CapHeader(0x20080522, 0)), (_CapData * 2)()) != 0:
        raise OSError("capset failed")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def which(name):
    return shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")


# ------------------------------------------------------------------------------------------- child


def is_plain(value, depth=0):
    """True if value is built only from plain built-in types (exact types: no subclasses, no __eq__ tricks)."""
    if depth > 50 or type(value) not in PLAIN_TYPES:
        return False
    if type(value) in (list, tuple, set, frozenset):
        return all(is_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return True


def set_limits(req, memory_limit):
    cpu = max(1, int(req["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if memory_limit:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (req["max_file_bytes"], req["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    nproc = req.get("max_processes")
    if nproc:  # counted per real uid: each worker runs as its own uid (the host's root is not bound by it)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def enter_child(fds, scratch):
    """Common set-up of a forked child: new session, scratch cwd, fds 0-3 (+ extra), empty environment."""
    os.setsid()
    os.chdir(scratch)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]  # out of the way of the dup2s below
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(len(fds), 1024)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    os.environ.clear()
    sys.argv = ["solution.py"]


def run_child(req, fds, scratch, memory_limit, program_id):
    """In the forked program child: isolate, limit, run. Never returns."""
    try:
        enter_child(fds, scratch)
        become_program(program_id)
        prctl(PR_SET_DUMPABLE, 1)  # its own /proc/self is readable again; the server and checker stay closed
        language = req.get("language", "python")
        if language != "python":
            spec = LANGUAGES[language]
            argv = [which(spec["run"][0]) or spec["run"][0]] + spec["run"][1:]
            if language == "javascript":
                argv[1:1] = [f"--max-old-space-size={int(req['memory_mb'])}", "--stack-size=4000"]
                memory_limit = memory_limit + NODE_RESERVE_MB * MB
            set_limits(req, memory_limit)
            os.closerange(3, 1024)  # result channels are for the Python harness only
            os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"})
            os.execve(argv[0], argv, dict(os.environ))
        set_limits(req, memory_limit)
        install_audit(req)
    except BaseException:
        os._exit(120)
    code = run_program(req)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


AUDIT_FLAGS = {
    "socket.connect": "network_attempt",
    "socket.bind": "network_attempt",
    "subprocess.Popen": "spawned_process",
    "os.system": "spawned_process",
    "os.exec": "spawned_process",
    "os.posix_spawn": "spawned_process",
    "os.fork": "spawned_process",
    "os.kill": "signal_sent",
    "os.killpg": "signal_sent",
    "ctypes.dlopen": "ctypes",
    "ctypes.dlsym": "ctypes",
}


def install_audit(req):
    """Report (once per kind) what the program tried: network, processes, signals, files outside its
    directory. Reports only; the isolation layer is what stops these."""
    if not req.get("audit", True):
        return
    _write, _dumps, _seen, _flags = os.write, json.dumps, set(), AUDIT_FLAGS
    _allowed = (
        "/usr/",
        "/lib",
        "/etc/ld.so",
        "/proc/self/",
        "/dev/null",
        "/dev/urandom",
        ".",
        "main.",
        "solution",
    )

    def report(flag):
        if flag not in _seen:
            _seen.add(flag)
            try:
                _write(3, (_dumps({"event": "flag", "flag": flag}) + "\n").encode())
            except OSError:
                pass

    def hook(event, args):
        flag = _flags.get(event)
        if flag:
            report(flag)
        elif event == "open" and args and isinstance(args[0], str):
            path = args[0]
            if path.startswith("/") and not path.startswith(_allowed) and not path.startswith(os.getcwd()):
                report("file_outside_scratch")

    sys.addaudithook(hook)


def run_program(req):
    # Keep private references: the program may rebind builtins, but not these locals.
    _write, _repr, _type, _dumps, _is_plain = os.write, repr, type, json.dumps, is_plain
    mode = req.get("kind", "program")

    def send(obj):
        try:
            _write(3, (_dumps(obj) + "\n").encode("utf-8"))
        except OSError:
            pass

    try:
        code = compile(req["code"], "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        traceback.print_exception(type(e), e, None)
        send({"event": "compile_error"})
        return 1
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__file__": "solution.py"}
    builtins_before = dict(vars(builtins))
    exit_code = 0
    try:
        exec(code, namespace)
    except SystemExit as e:
        send({"event": "flag", "flag": "exit_before_tests"} if mode != "program" else {"event": "exit"})
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if mode == "program":
            return exit_code
    except MemoryError:
        send({"event": "memory_error"})
        traceback.print_exc()
        return 1
    except BaseException:
        traceback.print_exc()
        if mode == "program":
            return 1
        send({"event": "module_error", "error": traceback.format_exc(limit=-3)})
        exit_code = 1
    if mode == "program":
        return exit_code
    current = vars(builtins)
    if len(current) != len(builtins_before) or any(
        builtins_before.get(k) is not v for k, v in current.items()
    ):
        # Undone, then reported: the harness below must run on the real builtins.
        current.clear()
        current.update(builtins_before)
        send({"event": "flag", "flag": "patched_builtins"})
    fn = namespace.get(req["entry_point"])
    if not callable(fn):
        send({"event": "no_entry_point"})
        return exit_code or 1

    def call(i, args):
        try:
            value = fn(*args)
        except SystemExit:
            return {
                "i": i,
                "ok": False,
                "error": "SystemExit raised inside the function",
                "flag": "exit_in_test",
            }
        except MemoryError:
            return {"i": i, "ok": False, "error": "MemoryError", "flag": "memory_error"}
        except BaseException as e:
            return {"i": i, "ok": False, "error": f"{_type(e).__name__}: {e}"[:2000]}
        if not _is_plain(value):
            return {
                "i": i,
                "ok": False,
                "error": f"returned a {_type(value).__name__}, not a plain value",
                "flag": "non_builtin_output",
            }
        try:
            return {"i": i, "ok": True, "value": _repr(value)}
        except BaseException as e:  # e.g. a repr too deep to build
            return {"i": i, "ok": False, "error": f"{_type(e).__name__} while encoding the result"}

    if mode == "calls":
        for i, args in enumerate(req["calls"]):
            send(call(i, args))
        send({"event": "done"})
        return exit_code
    # check: serve calls from the checker on fd 4 until it closes the pipe. This process is killed when
    # the checker is done, so what the program printed is flushed now and after every call.
    flush()
    send({"event": "ready"})
    _read, _loads, _literal = os.read, json.loads, ast.literal_eval
    pending, i = b"", 0
    while True:
        while b"\n" not in pending:
            chunk = _read(4, 1 << 16)
            if not chunk:
                return exit_code
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        try:
            args = _literal(_loads(line)["args"])
        except BaseException as e:
            send({"i": i, "ok": False, "error": f"arguments could not be passed: {_type(e).__name__}"})
        else:
            send(call(i, args))
        flush()
        i += 1


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


# ----------------------------------------------------------------------------------------- checker


class CandidateError(Exception):
    """The program under test failed to answer a call (raised inside the checker's test code)."""


class Candidate:
    """Stands for the program's entry point inside trusted test code: each call is forwarded to the
    program's process; the answer comes back as a literal, so it cannot be an object with a rigged __eq__."""

    def __init__(self, call_w, ret_r, flags):
        self.call_w, self.ret_r, self.flags, self.pending, self.calls = call_w, ret_r, flags, b"", 0

    def __call__(self, *args):
        try:
            os.write(self.call_w, (json.dumps({"args": repr(args)}) + "\n").encode())
        except OSError:
            raise CandidateError("the program is no longer running") from None
        msg = self.next_message()
        index, self.calls = self.calls, self.calls + 1
        if msg.get("i") != index:
            self.flags.add("result_channel_tampered")
            raise CandidateError("the answer channel was tampered with")
        if not msg.get("ok"):
            raise CandidateError(msg.get("error", "error"))
        try:
            return ast.literal_eval(msg["value"])
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            specials = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
            if msg["value"] in specials:
                return specials[msg["value"]]
            raise CandidateError("returned a value that is not a plain literal") from None

    def next_message(self):
        """The next answer from the program; its events and flags are recorded on the way."""
        while True:
            while b"\n" not in self.pending:
                chunk = os.read(self.ret_r, 1 << 16)
                if not chunk:
                    raise CandidateError("the program ended before answering")
                self.pending += chunk
            line, self.pending = self.pending.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                self.flags.add("result_channel_tampered")
                continue
            if not isinstance(msg, dict):
                self.flags.add("result_channel_tampered")
            elif msg.get("event") == "flag":
                self.flags.add(str(msg.get("flag")))
            elif "event" in msg:
                return msg
            else:
                if msg.get("flag"):
                    self.flags.add(str(msg["flag"]))
                return msg


def run_checker(secret, fds, req):
    """In the forked checker child: run each test's `check(candidate)`; report one verdict per test."""
    call_w, ret_r, verdict_w = fds
    try:
        drop_capabilities()
        os.setsid()
        os.chdir("/")  # not the program's directory: that belongs to the program's uid
        devnull = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        keep = {call_w, ret_r, verdict_w}
        for fd in range(3, 1024):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        cpu = max(1, int(req["cpu_s"] + 0.999)) * 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        flags = set()
        candidate = Candidate(call_w, ret_r, flags)

        def emit(obj):
            data = (json.dumps(obj) + "\n").encode()
            while data:
                data = data[os.write(verdict_w, data) :]

        first = candidate.next_message()
        while "i" in first:  # an answer before any question: forged by the program's module code
            flags.add("result_channel_tampered")
            first = candidate.next_message()
        if first.get("event") != "ready":
            emit({"event": first.get("event"), "flags": sorted(flags)})
            os._exit(0)
        for i, test_code in enumerate(secret["tests"]):
            namespace = {"__name__": "__check__"}
            try:
                exec(compile(test_code, "test.py", "exec"), namespace)
                # HumanEval's tests may call the function by its own name (they ran in the program's
                # namespace there): that name is the candidate too.
                if req.get("entry_point"):
                    namespace[req["entry_point"]] = candidate
                namespace["check"](candidate)
                emit({"i": i, "ok": True})
            except AssertionError as e:
                emit(
                    {
                        "i": i,
                        "ok": False,
                        "error": f"assertion failed{': ' + str(e) if str(e) else ''}"[:2000],
                    }
                )
            except CandidateError as e:
                emit({"i": i, "ok": False, "error": str(e)[:2000]})
            except BaseException as e:
                emit({"i": i, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})
        emit({"event": "done", "flags": sorted(flags)})
    except CandidateError as e:
        try:
            os.write(verdict_w, (json.dumps({"event": "no_answer", "error": str(e)}) + "\n").encode())
        except OSError:
            pass
    except BaseException:
        pass
    os._exit(0)


# ------------------------------------------------------------------------------------------ parent


class Server:
    def __init__(self, scratch_root, program_id=None):
        self.scratch_root = scratch_root
        self.program_id = program_id  # programs' uid and gid (a worker with two uids), else None: ours
        self.base_vm = vm_size_bytes()
        self.pid1 = os.getpid() == 1
        if not self.pid1:
            prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of an execution come back to us, to be killed
        prctl(PR_SET_DUMPABLE, 0)  # no ptrace and no /proc/<pid>/mem, even by a program sharing our uid
        self.rlimits = {name: resource.getrlimit(r) for name, r in RLIMITS.items()}

    def health(self):
        """None if this server is as it started, else what changed: only a program that reached it (possible
        only with one uid for both) changes it, and the host then replaces this worker."""
        try:
            changed = [name for name, r in RLIMITS.items() if resource.getrlimit(r) != self.rlimits[name]]
            if changed:
                return f"the server's {', '.join(changed)} changed"
            os.close(os.open("/proc/self/stat", os.O_RDONLY))  # it can still open files
        except OSError as e:
            return f"the server cannot work: {e}"
        return None

    def execute(self, req):
        scratch = tempfile.mkdtemp(dir=self.scratch_root)
        os.chmod(scratch, 0o700)
        if self.program_id is not None:
            os.chown(scratch, self.program_id, self.program_id)
        try:
            language = req.get("language", "python")
            if language != "python" and language not in LANGUAGES:
                return {"status": "sandbox_error", "stderr": f"unknown language '{language}'"}
            if language != "python":
                spec = LANGUAGES[language]
                with open(os.path.join(scratch, spec["file"]), "w", encoding="utf-8") as f:
                    f.write(req["code"])
                if "compile" in spec:
                    failed = self.compile(spec, scratch, req)
                    if failed:
                        return failed
                    result = self.run(req, scratch)
                    result["compile_time_s"] = self.compile_time_s
                    return result
            return self.run(req, scratch)
        finally:
            self.cleanup()

    def compile(self, spec, scratch, req):
        argv = [which(spec["compile"][0]) or spec["compile"][0]] + spec["compile"][1:]

        def limits():  # runs after the switch to the program's uid (subprocess's user=, group=)
            os.setsid()
            prctl(PR_SET_NO_NEW_PRIVS, 1)
            limit = COMPILE_MEMORY_MB * MB
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * MB, 64 * MB))

        run_as = {}
        if self.program_id is not None:  # the compiler reads the program's text: it runs as the program
            run_as = {"user": self.program_id, "group": self.program_id, "extra_groups": []}
        timeout = float(req.get("compile_timeout_s") or COMPILE_TIMEOUT_S)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                argv,
                cwd=scratch,
                capture_output=True,
                timeout=timeout,
                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": scratch},
                preexec_fn=limits,
                stdin=subprocess.DEVNULL,
                **run_as,
            )
        except subprocess.TimeoutExpired as e:
            message = (e.stderr or b"").decode("utf-8", "replace")
            return {
                "status": "compile_error",
                "stderr": message + f"\ncompiler timed out after {timeout:g} s",
                "compile_timed_out": True,
                "wall_time_s": time.monotonic() - start,
            }
        except OSError as e:
            return {"status": "sandbox_error", "stderr": f"cannot run {argv[0]}: {e}"}
        if proc.returncode != 0:
            cap = int(req["max_output_bytes"])
            message = (proc.stderr + proc.stdout).decode("utf-8", "replace")
            return {
                "status": "compile_error",
                "exit_code": proc.returncode,
                "stderr": message[:cap],
                "stderr_truncated": len(message) > cap,
                "wall_time_s": time.monotonic() - start,
            }
        self.compile_time_s = time.monotonic() - start
        return None

    def run(self, req, scratch):
        kind = req.get("kind", "program")
        stdin_path = os.path.join(scratch, ".stdin")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(req.get("stdin") or "")
        stdin_fd = os.open(stdin_path, os.O_RDONLY)
        os.unlink(stdin_path)  # the open fd keeps the data; the program's directory holds only its code
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        call_r = call_w = None
        child_fds = [stdin_fd, out_w, err_w, res_w]
        if kind == "check":
            call_r, call_w = os.pipe()
            child_fds.append(call_r)
        memory_limit = self.base_vm + int(req["memory_mb"]) * MB
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child must never return into the server loop, whatever the program did
            try:
                for fd in (out_r, err_r, res_r, call_w, 0, 1):
                    if fd is not None:
                        os.close(fd)
                run_child(req, child_fds, scratch, memory_limit, self.program_id)
            finally:
                os._exit(121)
        for fd in child_fds:
            os.close(fd)
        checker = None
        verdict_r = None
        if kind == "check":
            # The test code follows the request on fd 0 and is read by the checker itself: it never exists
            # in this server's memory, so no later program can find it in memory inherited by a fork.
            verdict_r, verdict_w = os.pipe()
            sync_r, sync_w = os.pipe()
            checker = os.fork()
            if checker == 0:
                try:
                    secret = read_msg(0) or {"tests": []}
                    os.write(sync_w, b"1")
                    os.close(sync_w)
                    for fd in (out_r, err_r, verdict_r, sync_r, 0, 1):
                        os.close(fd)
                    run_checker(secret, (call_w, res_r, verdict_w), req)
                finally:
                    os._exit(121)
            for fd in (verdict_w, call_w, res_r, sync_w):
                os.close(fd)
            read_ok = select.select([sync_r], [], [], 10.0)[0] and os.read(sync_r, 1) == b"1"
            os.close(sync_r)
            if (
                not read_ok
            ):  # the checker never took its message: drop it here, or it would be the next request
                read_msg(0)
            res_r = verdict_r
        try:
            return collect(req, pid, start, out_r, err_r, res_r, checker)
        finally:
            for fd in (out_r, err_r, res_r):
                os.close(fd)

    def cleanup(self):
        """Kill every process the execution left behind, reap them, and wipe the scratch area."""
        for _ in range(100):
            victims = self.leftovers()
            if not victims:
                break
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.reap()
            time.sleep(0.001)
        self.reap()
        for name in os.listdir(self.scratch_root):
            path = os.path.join(self.scratch_root, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, onerror=_unlock_and_retry)
                else:
                    os.unlink(path)
            except OSError:
                pass

    def leftovers(self):
        me = os.getpid()
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in (me, 1):
                continue
            if self.pid1:
                found.append(int(name))  # our namespace holds only us and what executions started
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                found.append(int(name))
        return found

    @staticmethod
    def reap():
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return


def _unlock_and_retry(function, path, _):
    """rmtree's error handler: a program may leave directories without write or search permission (a worker
    with two uids overrides that; one with a single uid owns them and can give the permission back)."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path, ignore_errors=True)
        else:
            function(path)
    except OSError:
        pass


def drain(fds, bufs, caps, over):
    """Read what is still buffered in the pipes of processes that were just killed."""
    fds = [fd for fd in fds if not over[fd]]
    while fds:
        ready, _, _ = select.select(fds, [], [], 0.05)
        if not ready:
            return
        for fd in ready:
            chunk = os.read(fd, 65536)
            room = caps[fd] - len(bufs[fd])
            if not chunk or room <= 0:
                fds.remove(fd)
                continue
            bufs[fd] += chunk[:room]


def collect(req, pid, start, out_r, err_r, res_r, checker=None):
    cap = int(req["max_output_bytes"])
    bufs = {out_r: bytearray(), err_r: bytearray(), res_r: bytearray()}
    caps = {out_r: cap, err_r: cap, res_r: RESULT_CAP}
    over = {out_r: False, err_r: False, res_r: False}
    # With a checker, the run ends when the checker is done (the program keeps serving calls till then).
    watched = checker if checker is not None else pid
    pidfd = os.pidfd_open(watched)
    deadline = start + float(req["timeout_s"])
    reason = None
    exited_at = None
    open_fds = [out_r, err_r, res_r]
    try:
        while open_fds:
            now = time.monotonic()
            if exited_at is None and now >= deadline:
                reason = "timeout"
                break
            if exited_at is not None and now >= exited_at + 0.05:
                break  # a descendant still holds a pipe open; it is killed below
            wait = (deadline if exited_at is None else exited_at + 0.05) - now
            ready, _, _ = select.select(
                open_fds + ([pidfd] if exited_at is None else []), [], [], max(wait, 0)
            )
            for fd in ready:
                if fd == pidfd:
                    exited_at = time.monotonic()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.remove(fd)
                    continue
                room = caps[fd] - len(bufs[fd])
                if len(chunk) > room:
                    bufs[fd] += chunk[: max(room, 0)]
                    over[fd] = True
                    reason = "output_limit"
                else:
                    bufs[fd] += chunk
            if reason:
                break
            if checker is not None and exited_at is not None and res_r not in open_fds:
                break
    finally:
        own_exit = checker is not None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        for target in (pid, checker):
            if target is None:
                continue
            try:
                os.killpg(target, signal.SIGKILL)  # the child's whole process group, stragglers included
            except ProcessLookupError:
                pass
        os.close(pidfd)
        drain(open_fds, bufs, caps, over)
    _, status, usage = os.wait4(pid, 0)
    if checker is not None:
        os.waitpid(checker, 0)
    wall = time.monotonic() - start
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    cpu = usage.ru_utime + usage.ru_stime
    if checker is not None and not own_exit and reason is None:
        sig, exit_code = None, 0  # stopped by us once the checker was done, not by a limit

    events, calls, flags = [], {}, []
    for line in bytes(bufs[res_r]).decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            flags.append("result_channel_tampered")
            continue
        if not isinstance(msg, dict):
            flags.append("result_channel_tampered")
        elif "i" in msg:
            if msg["i"] in calls:
                flags.append("result_channel_tampered")
            else:
                calls[msg["i"]] = msg
                if msg.get("flag"):
                    flags.append(msg["flag"])
        elif msg.get("event") == "flag":
            flags.append(msg.get("flag"))
        else:
            events.append(msg.get("event"))
            flags.extend(msg.get("flags") or [])
            if msg.get("event") == "no_answer":
                events.append("module_error")
    if "result_channel_tampered" in flags and req.get("kind") == "calls":
        calls = {}  # forged answers cannot be told from real ones: none counts
        events.append("tampered")
    kind = req.get("kind", "program")
    n_tests = len(req["calls"]) if kind == "calls" else int(req.get("n_tests") or 0)
    ended_honestly = {"compile_error", "tampered", "no_entry_point"} & set(events)
    if kind != "program" and "done" not in events and reason is None and not ended_honestly:
        flags.append("exit_before_tests" if not calls else "exit_during_tests")

    if reason == "timeout" or sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= req["cpu_s"]):
        status_name = "timeout"
    elif reason == "output_limit":
        status_name = "output_limit"
    elif "compile_error" in events:
        status_name = "compile_error"
    elif "memory_error" in events or "memory_error" in flags:
        status_name = "memory_limit"
    elif (
        sig is not None
        or exit_code not in (0, None)
        or "module_error" in events
        or "no_entry_point" in events
    ):
        status_name = "runtime_error"
    else:
        status_name = "ok"
    stderr = bytes(bufs[err_r]).decode("utf-8", "replace")
    if "no_entry_point" in events:
        stderr += f"\nNameError: entry point '{req['entry_point']}' is not defined\n"
    return {
        "status": status_name,
        "exit_code": exit_code,
        "signal": sig,
        "stdout": bytes(bufs[out_r]).decode("utf-8", "replace"),
        "stderr": stderr,
        "stdout_truncated": over[out_r],
        "stderr_truncated": over[err_r],
        "wall_time_s": wall,
        "cpu_time_s": cpu,
        "max_rss_mb": usage.ru_maxrss / 1024.0,
        "calls": [calls.get(i) for i in range(n_tests)] if kind != "program" else None,
        "flags": sorted(set(f for f in flags if f)),
    }


def prepare(setup, scratch_root):
    """Extra import paths first on sys.path, then the modules to preload, imported once here so that every
    forked execution finds them loaded (e.g. a verifier's package). While they import, math libraries are
    held to one thread (this process forks: a thread pool would not survive into its children) and
    temporary files go to the scratch area; then the environment is emptied again."""
    sys.path[:0] = setup.get("path") or []
    saved = dict(os.environ)
    os.environ.update(
        {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TMPDIR": scratch_root}
    )
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, scratch_root
    protocol = os.dup(1)
    os.dup2(2, 1)  # what an import prints must not land in the protocol pipe
    for name in setup.get("preload") or []:
        try:
            __import__(name)
        except BaseException as e:
            sys.stderr.write(
                f"cannot preload module '{name}' (sys.path {sys.path}): {type(e).__name__}: {e}\n"
            )
            sys.stderr.flush()
            os._exit(3)
    flush()
    os.dup2(protocol, 1)
    os.close(protocol)
    os.environ.clear()
    os.environ.update(saved)
    tempfile.tempdir = saved_tempdir


def read_int(path):
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # No handler for SIGINT: as PID 1 of its namespace the server then receives no signal from a program
    # (the kernel drops what PID 1 has no handler for); children get the default back (enter_child).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}  # isolation.Isolation.worker_config
    scratch_root = config.get("scratch") or tempfile.mkdtemp(prefix="tempering-sbx-")
    program_id = config.get("program_id")
    os.makedirs(scratch_root, exist_ok=True)
    if config.get("path") or config.get("preload"):
        prepare(config, scratch_root)
    server = Server(scratch_root, program_id)
    write_msg(
        1,
        {
            "ready": True,
            "pid1": server.pid1,
            "uid": os.getuid(),
            "program_uid": program_id,
            "max_user_namespaces": read_int("/proc/sys/user/max_user_namespaces"),
        },
    )
    try:
        while True:
            req = read_msg(0)
            if req is None:
                break
            try:
                resp = server.execute(req)
            except Exception:
                resp = {"status": "sandbox_error", "stderr": traceback.format_exc()}
            damage = server.health()
            if damage:
                resp["worker_damaged"] = damage
            resp["id"] = req.get("id")  # the host matches every answer to its request by this id
            write_msg(1, resp)
    finally:
        if not config.get("scratch"):
            shutil.rmtree(scratch_root, ignore_errors=True)


if __name__ == "__main__":
    main()
