"""The agent fork server: runs a user's agent once per sample, each run a forked child with a time limit.

Started by `runner.AgentRunner` (inside bubblewrap where it works) with its settings as the one argument:
{"socket": the recording proxy's Unix socket, "entry": "package.module:function" or null, "command": [argv]
or null, "path": directories put first on sys.path}. It imports the entry once (so each run costs a fork,
not an interpreter start and the agent library's import), says `{"ready": true}` (or the import's error) on
stdout, then reads one job per line on stdin: {"index", "task", "api_key", "timeout_s"}. Each job runs in a
child of its own process group (the server is PID 1 of the container, so no signal from a run reaches it,
and it reaps what runs leave behind): the child listens on 127.0.0.1 (inside the container's own network
namespace, whose only other way out is the proxy's socket) and relays every connection to the proxy, then
calls `function(task, base_url, api_key)` - or runs the command with the task as JSON on stdin and
OPENAI_BASE_URL / OPENAI_API_KEY set - and reports its answer: {"index", "status": ok | error | timeout,
"answer", "error"} on stdout. A child past its time limit is killed with its whole process group.

Standard library only (it runs where nothing but the agent's own packages may be importable).
"""

import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

MAX_RESULT = 1 << 20  # bytes of a child's report read; past it, the rest is dropped


def relay(unix_path: str) -> int:
    """A TCP listener on 127.0.0.1 whose connections are piped to the Unix socket; returns its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept():
        while True:
            conn, _ = listener.accept()
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(unix_path)
            except OSError:
                conn.close()
                continue
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


def run_child(settings: dict, function, job: dict, out_fd: int, siblings: list[int]) -> None:
    """In the forked child: the relay, the agent, and its report on `out_fd`. Never returns."""
    report = {"index": job["index"], "status": "ok", "answer": None, "error": None}
    try:
        os.setpgid(0, 0)  # a process group of its own (the server sets it too), killed as one at its limit
        for fd in siblings:  # the other runs' report pipes and the server's channel: none of its business
            os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        base_url = f"http://127.0.0.1:{relay(settings['socket'])}/v1"
        if function is not None:
            answer = function(job["task"], base_url, job["api_key"])
        else:
            env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": job["api_key"]}
            done = subprocess.run(
                settings["command"], input=json.dumps(job["task"]), capture_output=True, text=True, env=env
            )
            sys.stderr.write(done.stderr[-4000:])
            if done.returncode != 0:
                raise RuntimeError(f"the agent command exited with {done.returncode}: {done.stderr[-500:]}")
            answer = done.stdout.strip() or None
        if isinstance(answer, dict):
            answer = answer.get("answer")
        report["answer"] = None if answer is None else str(answer)[: MAX_RESULT // 8]
    except BaseException as e:  # noqa: BLE001 - whatever the agent raised is its sample's error
        report["status"], report["error"] = "error", "".join(traceback.format_exception(e))[-2000:]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    data = json.dumps(report).encode()
    while data:
        data = data[os.write(out_fd, data[:65536]) :]
    os._exit(0)


def main() -> None:
    settings = json.loads(sys.argv[1])
    sys.path[:0] = settings["path"]
    channel = os.dup(1)  # the protocol's own: whatever the agent prints (at import too) goes to stderr
    os.dup2(2, 1)
    sys.stdout = os.fdopen(channel, "w")
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    function = None
    try:
        if settings.get("entry"):
            module, _, name = settings["entry"].partition(":")
            function = getattr(importlib.import_module(module), name)
    except BaseException as e:  # noqa: BLE001
        print(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    out = sys.stdout
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ, None)
    children: dict[int, dict] = {}  # read end -> {pid, job, deadline, data}
    buffer, open_input = b"", True
    while open_input or children:
        now = time.monotonic()
        wait = min((c["deadline"] for c in children.values()), default=now + 1.0) - now
        for key, _ in sel.select(max(0.0, min(wait, 1.0))):
            if key.data is None:  # a job, or the host closing our stdin
                chunk = os.read(sys.stdin.fileno(), 65536)
                if not chunk:
                    open_input = False
                    sel.unregister(sys.stdin)
                    continue
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    job = json.loads(line)
                    r, w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        os.close(r)
                        run_child(settings, function, job, w, [channel, *children])
                    try:
                        os.setpgid(pid, pid)  # its group now, so a kill never races its setsid
                    except OSError:
                        pass
                    os.close(w)
                    deadline = time.monotonic() + float(job["timeout_s"])
                    children[r] = {"pid": pid, "job": job, "deadline": deadline, "data": b""}
                    sel.register(r, selectors.EVENT_READ, r)
            else:
                child = children[key.data]
                chunk = os.read(key.data, 65536)
                if chunk and len(child["data"]) < MAX_RESULT:
                    child["data"] += chunk
                elif not chunk:
                    finish(sel, children, key.data, out, None)
        for fd, child in list(children.items()):
            if time.monotonic() > child["deadline"]:
                finish(sel, children, fd, out, "timeout")
        reap()


def reap() -> None:
    """As PID 1 of its container the server inherits every orphan: collect the ones that have exited."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def finish(sel, children: dict, fd: int, out, status: str | None) -> None:
    """Reap a child (killing its process group first on a timeout) and report it."""
    child = children.pop(fd)
    sel.unregister(fd)
    os.close(fd)
    index = child["job"]["index"]
    if status == "timeout":
        try:
            os.killpg(child["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        report = {"index": index, "status": "timeout", "answer": None, "error": "time limit"}
    else:
        try:
            report = json.loads(child["data"])
        except ValueError:
            report = {"index": index, "status": "error", "answer": None, "error": "no report (it died)"}
        try:
            os.killpg(child["pid"], signal.SIGKILL)  # what it left running (a command's children)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.waitpid(child["pid"], 0)
    except ChildProcessError:  # `reap` collected it already
        pass
    out.write(json.dumps(report) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
