"""The user's agent, confined: one fork server (`_agent_worker.py`) that runs it once per sample.

Under bubblewrap (`isolation: bwrap`, or `auto` where it works) the server is PID 1 of fresh user, PID,
network, IPC and UTS namespaces (so no signal from a run can reach it): its network has no interface but its own loopback, so the one way out is
the recording proxy's Unix socket, bound in (each run relays its `base_url` on 127.0.0.1 to it). It sees the
host's /usr, the Python environment and the import paths read-only - with the run directory (data,
checkpoints, logs) hidden under an empty tmpfs even where it lies below one of them - a small tmpfs as /tmp,
and an environment of its own: none of the trainer's variables (credentials, tokens) reach it. It dies
with the trainer. Without bubblewrap (`isolation: process`) it is a plain child process, on the host's
network and files; `auto` says so once.

The server is started once per run (the agent module and its library are imported once); each sample is a
forked child with a time limit, killed with its process group when it runs over (`AgentSection.timeout_s`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from tempering.errors import ConfigError, TemperingError

WORKER = Path(__file__).with_name("_agent_worker.py")
PROXY_DIR = "/run/tempering-proxy"
"""Where a confined agent sees the proxy's socket directory."""
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
"""The agent's whole environment (plus its import path): nothing of the trainer's."""
_warned: set[str] = set()


def import_roots(entry: str | None) -> list[str]:
    """Directories the agent needs to import: the interpreter's path, and the entry's own package root."""
    roots = [p for p in sys.path if p and os.path.isdir(p)]
    if entry:
        top = entry.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None:
            raise ConfigError(f"agent.entry '{entry}': no module '{top}' on the import path")
        places = list(spec.submodule_search_locations or []) or [spec.origin or ""]
        roots += [str(Path(p).parent) for p in places if p]
    return list(dict.fromkeys(os.path.abspath(p) for p in roots))


def bwrap_command(bwrap: str, roots: list[str], socket_dir: str, hidden: list[str]) -> list[str]:
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL"]
    args += ["--clearenv"]
    args += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    for top in ("bin", "sbin", "lib", "lib64"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for etc in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime", "/etc/ssl"):
        args += ["--ro-bind-try", etc, etc]
    args += ["--size", str(64 << 20), "--tmpfs", "/tmp"]  # first: a bound path under /tmp stays visible
    bound = sorted({sys.prefix, sys.base_prefix, *roots}, key=len)
    for root in bound:
        if not root.startswith("/usr/") and root != "/usr":
            args += ["--ro-bind", root, root]
    for path in hidden:  # the trainer's run directory, even under a bound path
        if any(path == r or path.startswith(r.rstrip("/") + "/") for r in bound):
            args += ["--size", str(1 << 20), "--tmpfs", path]
    args += ["--ro-bind", socket_dir, PROXY_DIR, "--chdir", "/tmp"]
    for key, value in ENV.items():
        args += ["--setenv", key, value]
    return args + ["--"]


def hidden_paths(paths) -> list[str]:
    """Each path as given and as resolved (a run directory reached through a symlink is hidden both ways)."""
    return list(dict.fromkeys(p for h in paths for p in (os.path.abspath(h), os.path.realpath(h))))


def resolve_isolation(wanted: str) -> str | None:
    """`bwrap` when bubblewrap runs here, else None (with the reason printed once for `auto`)."""
    if wanted == "process":
        return None
    bwrap = shutil.which("bwrap")
    works = bwrap and subprocess.run([bwrap, "--unshare-all", "--ro-bind", "/", "/", "true"]).returncode == 0
    if works:
        return bwrap
    if wanted == "bwrap":
        raise ConfigError("agent.isolation: bwrap, but bubblewrap is not installed or cannot start here")
    if "auto" not in _warned:
        _warned.add("auto")
        print(
            "note: bubblewrap is unavailable; agents run as plain processes, on the host's network and files"
        )
    return None


class AgentRunner:
    """The fork server, started at once; `run(index, task, api_key)` -> a Future of its report."""

    def __init__(self, section, socket_path: str, hidden: list[str] = ()):
        self.section = section
        roots = import_roots(section.entry)
        bwrap = resolve_isolation(section.isolation)
        self.confined = bwrap is not None
        inside = f"{PROXY_DIR}/{Path(socket_path).name}" if bwrap else socket_path
        settings = {"socket": inside, "entry": section.entry, "command": section.command, "path": roots}
        argv = [sys.executable, "-s", "-B", "-c", WORKER.read_text(), json.dumps(settings)]
        if bwrap:
            argv = bwrap_command(bwrap, roots, str(Path(socket_path).parent), hidden_paths(hidden)) + argv
        env = None if bwrap else {**ENV, "PYTHONPATH": os.pathsep.join(roots)}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
        )
        self.log: deque[str] = deque(maxlen=200)
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            ready = json.loads(self.proc.stdout.readline() or '{"ready": false, "error": "it exited"}')
        except ValueError:
            ready = {"ready": False, "error": "it said something else than that it is ready"}
        if not ready["ready"]:
            self.close()
            tail = "".join(self.log)[-800:]
            raise TemperingError(f"the agent could not start: {ready['error']}{': ' + tail if tail else ''}")
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
        self.dead = False
        threading.Thread(target=self._read, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                try:
                    report = json.loads(line)
                    index = report["index"]
                except (ValueError, KeyError, TypeError):
                    continue  # not a report: the channel is the server's own, this is not its line
                with self.lock:
                    future = self.pending.pop(index, None)
                if future is not None:
                    future.set_result(report)
        finally:
            with self.lock:  # the server died: every run still waiting fails, and later runs refuse
                left, self.pending, self.dead = self.pending, {}, True
            for future in left.values():
                future.set_result({"status": "error", "answer": None, "error": "the agent server exited"})

    def run(self, index: int, task: dict, api_key: str) -> Future:
        future: Future = Future()
        with self.lock:
            if self.dead:
                tail = "".join(self.log)[-800:]
                raise TemperingError(f"the agent server exited{': ' + tail if tail else ''}")
            self.pending[index] = future
        job = {"index": index, "task": task, "api_key": api_key, "timeout_s": self.section.timeout_s}
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError:
            with self.lock:
                self.pending.pop(index, None)
            future.set_result({"status": "error", "answer": None, "error": "the agent server exited"})
        return future

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
