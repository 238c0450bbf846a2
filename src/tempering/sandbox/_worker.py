"""Sandbox fork server: a long-lived process that forks a fresh, rlimited child per execution.

This file is run as a script by any python3 (it imports nothing from tempering). Protocol on fds 0/1:
each message is a 4-byte big-endian length followed by UTF-8 JSON. One request -> one response.

The child runs the program in its own session and process group, in a fresh scratch directory, with
rlimits on CPU, address space, file size and open files. Its stdout/stderr are pipes read here up to a
cap. For function-call tests the child sends back only the *values* the entry point returned (as repr
of plain built-in types) on fd 3; expected outputs never enter this process, so the comparison - and
the verdict - happen in the host, out of the program's reach.
"""
# ruff: noqa: I001  (the second import block, preloaded for solutions, is grouped on purpose)

import builtins
import json
import os
import resource
import select
import shutil
import signal
import struct
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
        data = data[os.write(fd, data):]


def vm_size_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


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


def run_child(req, fds, scratch, memory_limit):
    """In the forked child: limit, isolate, run. Never returns."""
    stdin_fd, out_w, err_w, res_w = fds
    try:
        os.setsid()
        cpu = max(1, int(req["cpu_s"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
        resource.setrlimit(resource.RLIMIT_FSIZE, (req["max_file_bytes"], req["max_file_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        nproc = req.get("max_processes")
        if nproc:  # not enforced for root: the isolation layer's pid limit covers that case
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.chdir(scratch)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(res_w, 3)
        os.closerange(4, 1024)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        os.environ.clear()
        sys.argv = ["solution.py"]
    except BaseException:
        os._exit(120)
    code = run_program(req)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


def run_program(req):
    # Keep private references: the program may rebind builtins, but not these locals.
    _write, _repr, _type, _dumps, _is_plain = os.write, repr, type, json.dumps, is_plain

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
        send({"event": "flag", "flag": "exit_before_tests"} if req.get("calls") is not None else {"event": "exit"})
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if req.get("calls") is None:
            return exit_code
    except MemoryError:
        send({"event": "memory_error"})
        traceback.print_exc()
        return 1
    except BaseException:
        traceback.print_exc()
        if req.get("calls") is None:
            return 1
        send({"event": "module_error", "error": traceback.format_exc(limit=-3)})
        exit_code = 1
    if req.get("calls") is None:
        return exit_code
    current = vars(builtins)
    if len(current) != len(builtins_before) or any(builtins_before.get(k) is not v for k, v in current.items()):
        # Undone, then reported: the harness below must run on the real builtins.
        current.clear()
        current.update(builtins_before)
        send({"event": "flag", "flag": "patched_builtins"})
    fn = namespace.get(req["entry_point"])
    if not callable(fn):
        send({"event": "no_entry_point"})
        return exit_code or 1
    for i, args in enumerate(req["calls"]):
        try:
            value = fn(*args)
        except SystemExit:
            send({"i": i, "ok": False, "error": "SystemExit raised inside the function", "flag": "exit_in_test"})
            continue
        except MemoryError:
            send({"i": i, "ok": False, "error": "MemoryError", "flag": "memory_error"})
            continue
        except BaseException as e:
            send({"i": i, "ok": False, "error": f"{_type(e).__name__}: {e}"[:2000]})
            continue
        if not _is_plain(value):
            send({"i": i, "ok": False, "error": f"returned a {_type(value).__name__}, not a plain value",
                  "flag": "non_builtin_output"})
            continue
        try:
            send({"i": i, "ok": True, "value": _repr(value)})
        except BaseException as e:  # e.g. a repr too deep to build
            send({"i": i, "ok": False, "error": f"{_type(e).__name__} while encoding the result"})
    send({"event": "done"})
    return exit_code


# ------------------------------------------------------------------------------------------ parent


def execute(req, base_dir, base_vm):
    scratch = tempfile.mkdtemp(dir=base_dir)
    stdin_path = os.path.join(scratch, ".stdin")
    with open(stdin_path, "w", encoding="utf-8") as f:
        f.write(req.get("stdin") or "")
    stdin_fd = os.open(stdin_path, os.O_RDONLY)
    os.unlink(stdin_path)  # the open fd keeps the data; the program's directory starts empty
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    memory_limit = base_vm + int(req["memory_mb"]) * MB
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child must never return into the server loop, whatever the program did
        try:
            os.close(out_r), os.close(err_r), os.close(res_r)
            run_child(req, (stdin_fd, out_w, err_w, res_w), scratch, memory_limit)
        finally:
            os._exit(121)
    for fd in (stdin_fd, out_w, err_w, res_w):
        os.close(fd)
    try:
        return collect(req, pid, start, out_r, err_r, res_r)
    finally:
        for fd in (out_r, err_r, res_r):
            os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)


def collect(req, pid, start, out_r, err_r, res_r):
    cap = int(req["max_output_bytes"])
    bufs = {out_r: bytearray(), err_r: bytearray(), res_r: bytearray()}
    caps = {out_r: cap, err_r: cap, res_r: RESULT_CAP}
    over = {out_r: False, err_r: False, res_r: False}
    pidfd = os.pidfd_open(pid)
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
            ready, _, _ = select.select(open_fds + ([pidfd] if exited_at is None else []), [], [], max(wait, 0))
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
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)  # the child's whole process group, stragglers included
        except ProcessLookupError:
            pass
        os.close(pidfd)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - start
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    cpu = usage.ru_utime + usage.ru_stime

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
    if req.get("calls") is not None and "done" not in events and reason is None:
        flags.append("exit_before_tests" if not calls else "exit_during_tests")

    if reason == "timeout" or sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= req["cpu_s"]):
        status_name = "timeout"
    elif reason == "output_limit":
        status_name = "output_limit"
    elif "compile_error" in events:
        status_name = "compile_error"
    elif "memory_error" in events or "memory_error" in flags:
        status_name = "memory_limit"
    elif sig is not None or exit_code not in (0, None) or "module_error" in events or "no_entry_point" in events:
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
        "calls": [calls.get(i) for i in range(len(req["calls"]))] if req.get("calls") is not None else None,
        "flags": sorted(set(f for f in flags if f)),
    }


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    base_dir = tempfile.mkdtemp(prefix="tempering-sbx-", dir=sys.argv[1] if len(sys.argv) > 1 else None)
    base_vm = vm_size_bytes()
    try:
        while True:
            req = read_msg(0)
            if req is None:
                break
            try:
                resp = execute(req, base_dir, base_vm)
            except Exception:
                resp = {"status": "sandbox_error", "stderr": traceback.format_exc()}
            write_msg(1, resp)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
