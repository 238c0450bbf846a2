"""The HTTP sandbox service and its client, against a real `tempering sandbox serve` on loopback."""

import socket
import subprocess
import sys
import time

import pytest

from tempering.config import load_config
from tempering.errors import SandboxError
from tempering.pipeline import make_sandbox
from tempering.sandbox import RemoteSandbox
from tempering.types import Task, TestCase


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tempering.cli", "sandbox", "serve", "--port", str(port),
                             "--workers", "2", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    client = RemoteSandbox(url, retries=0)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.health()
            break
        except SandboxError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}") from None
            time.sleep(0.2)
    client.close()
    return proc, url


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_remote_runs_programs_and_grades_tests_locally(server):
    with RemoteSandbox(server) as sb:
        health = sb.health()
        assert health["status"] == "ok" and health["workers"] == 2 and health["protections"]
        r = sb.run("print(input() * 2)", stdin="ab\n")
        assert (r.status, r.stdout) == ("ok", "abab\n")
        assert sb.run("int main( {", language="c").status == "compile_error"
        task = Task(id="t", domain="d", prompt="", entry_point="f",
                    tests=[TestCase(input=[1], output=2), TestCase(input=[2], output=5)])
        r = sb.run_tests(task, "def f(x):\n    return 2 * x\n")
        assert [t.passed for t in r.tests] == [True, False]
        results = sb.run_batch([sb.request(f"print({i})") for i in range(20)])
        assert [x.stdout for x in results] == [f"{i}\n" for i in range(20)]


def test_expected_outputs_never_reach_the_service(server, monkeypatch):
    sent = []
    with RemoteSandbox(server) as sb:
        original = sb._client.request

        def spy(method, path, **kw):
            sent.append(kw.get("json"))
            return original(method, path, **kw)

        monkeypatch.setattr(sb._client, "request", spy)
        task = Task(id="t", domain="d", prompt="", entry_point="f", tests=[TestCase(input=[1], output=987654321)])
        sb.run_tests(task, "def f(x):\n    return x\n")
    assert "987654321" not in repr(sent)


def test_a_server_that_is_down_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    with RemoteSandbox(url, retries=1, backoff_s=0.01) as sb, pytest.raises(SandboxError, match=url):
        sb.run("print(1)")


def test_a_busy_server_pushes_back_and_the_client_retries():
    proc, url = start_server("--max-pending", "1")
    try:
        with RemoteSandbox(url, retries=0, batch_size=2) as sb, pytest.raises(SandboxError, match="413"):
            sb.run_batch([sb.request("print(1)"), sb.request("print(2)")])  # 2 executions > max 1
        with RemoteSandbox(url, retries=8, backoff_s=0.05, batch_size=1, concurrency=4) as sb:
            # four single requests at once against room for one: some get 429, and retrying gets them all done
            results = sb.run_batch([sb.request("import time\ntime.sleep(0.1)\nprint(7)") for _ in range(4)])
        assert [r.stdout for r in results] == ["7\n"] * 4
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_trainer_uses_a_remote_sandbox_by_config(server, tmp_path):
    cfg = load_config("configs/smoke.yaml", [f"sandbox.url={server}", f"run.dir={tmp_path}/run"])
    sb = make_sandbox(cfg)
    assert isinstance(sb, RemoteSandbox) and sb.run("print(3)").stdout == "3\n"
    sb.close()
    down = load_config("configs/smoke.yaml", [f"sandbox.url=http://127.0.0.1:{free_port()}"])
    with pytest.raises(SandboxError, match="not reachable"):
        make_sandbox(down)
