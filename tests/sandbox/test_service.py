"""The HTTP sandbox service and its client, against a real `tempering sandbox serve` on loopback."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tempering.config import load_config
from tempering.errors import SandboxError
from tempering.sandbox import RemoteSandbox
from tempering.sandbox.service import TOKEN_ENV, serve
from tempering.types import Task, TestCase
from tempering.workspace import make_sandbox


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, token: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV} | ({TOKEN_ENV: token} if token else {})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tempering.cli",
            "sandbox",
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    client = RemoteSandbox(url, retries=0, token=token)
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
        task = Task(
            id="t",
            domain="d",
            prompt="",
            entry_point="f",
            tests=[TestCase(input=[1], output=2), TestCase(input=[2], output=5)],
        )
        r = sb.run_tests(task, "def f(x):\n    return 2 * x\n")
        assert [t.passed for t in r.tests] == [True, False]
        results = sb.run_batch([sb.request(f"print({i})") for i in range(20)])
        assert [x.stdout for x in results] == [f"{i}\n" for i in range(20)]


def test_expected_outputs_never_reach_the_service(server, monkeypatch):
    sent = []
    with RemoteSandbox(server) as sb:
        original = sb._http.client.request

        def spy(method, path, **kw):
            sent.append(kw.get("json"))
            return original(method, path, **kw)

        monkeypatch.setattr(sb._http.client, "request", spy)
        task = Task(
            id="t", domain="d", prompt="", entry_point="f", tests=[TestCase(input=[1], output=987654321)]
        )
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


def execute_raw(url: str, code: str, limits: dict) -> httpx.Response:
    """POST /execute with `limits` written as given: json.dumps spells NaN and Infinity as Python's json reads them."""
    body = json.dumps({"requests": [{"code": code, "language": "python", "limits": limits}]})
    return httpx.post(
        f"{url}/execute", content=body, headers={"Content-Type": "application/json"}, timeout=60
    )


BAD_LIMITS = [
    ("timeout_s", float("nan")),
    ("timeout_s", 0),
    ("timeout_s", -1),
    ("cpu_s", float("inf")),
    ("compile_timeout_s", -float("inf")),
    ("memory_mb", 0),
    ("memory_mb", -5),
    ("max_output_bytes", 0.5),
    ("max_file_bytes", -1),
    ("max_processes", 0),
    ("max_processes", True),
    ("timeout_s", "2"),
    ("timeout_s", None),
]


def test_impossible_limits_are_refused_before_any_worker_sees_them(server):
    """NaN, infinities, 0, negatives and non-numbers: 422 naming the field; the workers never see them."""
    for name, value in BAD_LIMITS:
        r = execute_raw(server, "print(1)", {name: value})
        assert r.status_code == 422 and f"limits.{name}" in r.json()["detail"], (name, value, r.text)
    r = execute_raw(server, "print(1)", {"timeout_s": 1.5, "max_file_bytes": 1 << 20})
    assert r.status_code == 200 and r.json()["results"][0]["stdout"] == "1\n"


def test_interleaved_clients_each_get_their_own_result(server):
    """Threads sending good and impossible requests at once: each good one gets its own program's output,
    each bad one its 422, and no answer goes to another request."""
    outcomes, bad = (
        [],
        [{"timeout_s": float("nan")}, {"timeout_s": 0}, {"timeout_s": -1}, {"max_file_bytes": -1}],
    )

    def client(c: int) -> None:
        for i in range(8):
            limits = bad[(c + i) % len(bad)] if i % 2 else {"timeout_s": 2.0}
            r = execute_raw(server, f"print('client {c} request {i}')", limits)
            result = r.json()["results"][0] if r.status_code == 200 else {"status": r.status_code}
            outcomes.append((c, i, result.get("stdout") or result["status"]))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == [
        (c, i, 422 if i % 2 else f"client {c} request {i}\n") for c in range(6) for i in range(8)
    ]


# ------------------------------------------------------------------------------------------ exposure

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def secured():
    """A service with a token, 64 KiB bodies, 4 executions held and 1 running per client."""
    proc, url = start_server(
        "--max-request-mb", "0.0625", "--client-pending", "4", "--client-concurrency", "1", token=TOKEN
    )
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_a_non_loopback_address_needs_a_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SandboxError, match="without a token"):
        serve("192.0.2.1", free_port())  # a documentation address: nothing is bound either way
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    cli = subprocess.run(
        [sys.executable, "-m", "tempering.cli", "sandbox", "serve", "--host", "192.0.2.1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert cli.returncode == 2 and "without a token" in cli.stderr
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(SandboxError, match="at least 16"):
        RemoteSandbox("http://127.0.0.1:1")


def test_a_service_with_a_token_refuses_everyone_else(secured, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
        for method, path in (("GET", "/health"), ("POST", "/execute"), ("POST", "/run_code")):
            assert httpx.request(method, secured + path, headers=headers, json={}).status_code == 401
    with RemoteSandbox(secured, retries=0) as anonymous, pytest.raises(SandboxError, match="401"):
        anonymous.run("print(1)")
    with RemoteSandbox(secured, token=TOKEN) as sb:
        assert sb.run("print(1)").stdout == "1\n"
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the client reads the token as the service does
    with RemoteSandbox(secured) as sb:
        assert sb.run("print(2)").stdout == "2\n"
    body = {"code": "print(3)", "language": "python"}
    assert httpx.post(f"{secured}/run_code?token={TOKEN}", json=body).json()["run_result"]["stdout"] == "3\n"


def test_request_size_and_per_client_caps(secured):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    big = {"code": "x = '" + "a" * (100 << 10) + "'", "language": "python"}
    r = httpx.post(f"{secured}/run_code", json=big, headers=auth)
    assert r.status_code == 413 and "bytes" in r.json()["detail"]
    with RemoteSandbox(secured, token=TOKEN, retries=0) as sb:
        with pytest.raises(SandboxError, match="413"):
            sb.run_batch([sb.request("print(1)") for _ in range(5)])  # more than the 4 a client may hold
        start = time.monotonic()
        results = sb.run_batch([sb.request("import time\ntime.sleep(0.3)\nprint(1)") for _ in range(2)])
        assert [r.stdout for r in results] == ["1\n", "1\n"]
        assert time.monotonic() - start >= 0.6  # one at a time for this client, although there are 2 workers
    codes = []

    def hold(seconds):
        body = {"code": f"import time\ntime.sleep({seconds})", "language": "python"}
        codes.append(httpx.post(f"{secured}/run_code", json=body, headers=auth, timeout=30).status_code)

    holders = [threading.Thread(target=hold, args=(1.5,)) for _ in range(4)]
    for t in holders:
        t.start()
    time.sleep(0.5)
    r = httpx.post(f"{secured}/run_code", json={"code": "print(1)", "language": "python"}, headers=auth)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    for t in holders:
        t.join()
    assert codes == [200] * 4


def test_a_client_cannot_raise_its_limits_past_the_services():
    """A client asks for an hour and 64 GB; the service holds it to its own maxima (1 s, 200 MB here)."""
    proc, url = start_server("--max-timeout-s", "1", "--max-memory-mb", "200")
    try:
        greedy = {"timeout_s": 3600.0, "cpu_s": 3600.0, "memory_mb": 65536}
        slow = {"code": "import time\ntime.sleep(5)\nprint('done')", "language": "python", "limits": greedy}
        hog = {"code": "x = bytearray(1 << 30)\nprint('allocated')", "language": "python", "limits": greedy}
        start = time.monotonic()
        r = httpx.post(f"{url}/execute", json={"requests": [slow, hog]}, timeout=60)
        assert r.status_code == 200
        slept, allocated = r.json()["results"]
        assert slept["status"] == "timeout" and time.monotonic() - start < 4
        assert allocated["status"] == "memory_limit" and "allocated" not in allocated["stdout"]
        fusion = httpx.post(
            f"{url}/run_code",
            timeout=60,
            json={
                "code": "x = bytearray(1 << 30)\nprint('allocated')",
                "language": "python",
                "run_timeout": 3600,
                "memory_limit_MB": 65536,
            },
        ).json()
        assert "allocated" not in (fusion["run_result"] or {}).get("stdout", "")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------------------- SandboxFusion


def run_code(url: str, **body):
    """A SandboxFusion client, written only from its documented POST /run_code shape."""
    payload = {
        "compile_timeout": 10,
        "run_timeout": 10,
        "memory_limit_MB": -1,
        "stdin": "",
        "files": {},
        "fetch_files": [],
        **body,
    }
    resp = httpx.post(
        url,
        content=json.dumps(payload),
        timeout=60,
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


CPP = "#include <iostream>\nint main() { int a, b; std::cin >> a >> b; std::cout << a * b << std::endl; }\n"


def test_a_sandboxfusion_client_works_unchanged(server, secured):
    for url in (f"{server}/run_code", f"{secured}/run_code?token={TOKEN}"):
        py = run_code(url, code="print(sum(map(int, input().split())))", language="python", stdin="2 3\n")
        assert py["status"] == "Success" and py["compile_result"] is None
        assert py["run_result"] | {"execution_time": 0} == {
            "status": "Finished",
            "execution_time": 0,
            "return_code": 0,
            "stdout": "5\n",
            "stderr": "",
        }
        cpp = run_code(url, code=CPP, language="cpp", stdin="6 7\n")
        assert cpp["status"] == "Success" and cpp["run_result"]["stdout"] == "42\n"
        assert cpp["compile_result"]["status"] == "Finished" and cpp["compile_result"]["return_code"] == 0
        failing = run_code(url, code="raise ValueError('boom')", language="python")
        assert failing["status"] == "Failed" and failing["run_result"]["status"] == "Finished"
        assert (
            failing["run_result"]["return_code"] == 1
            and "ValueError: boom" in failing["run_result"]["stderr"]
        )
    broken = run_code(f"{server}/run_code", code="int main( {", language="cpp")
    assert broken["status"] == "Failed" and broken["run_result"] is None
    assert broken["compile_result"]["return_code"] != 0 and "error" in broken["compile_result"]["stderr"]
    slow = run_code(f"{server}/run_code", code="while True: pass", language="python", run_timeout=0.5)
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    assert slow["run_result"]["return_code"] is None
    js = run_code(f"{server}/run_code", code="console.log(6 * 7)", language="nodejs")
    assert js["status"] == "Success" and js["run_result"]["stdout"] == "42\n"
    other = run_code(f"{server}/run_code", code="class A {}", language="java")
    assert other["status"] == "SandboxError" and "not supported" in other["message"]
