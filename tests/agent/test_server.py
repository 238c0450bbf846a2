"""`tempering serve` on loopback (a real process started and stopped here): the OpenAI client, streaming,
batching, the agent as an HTTP client, /metrics, and its exposure rules."""

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tempering.agent.backends import HTTPChat, LocalChat
from tempering.agent.repair import RepairSettings, repair
from tempering.envs import EnvContext
from tempering.errors import TemperingError
from tempering.models.loading import load_model, load_tokenizer

KEY = "k" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model_dir, *extra, env=None):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPERING_SERVE")} | (env or {})
    proc = subprocess.Popen([sys.executable, "-m", "tempering.cli", "serve", str(model_dir), "--port", str(port),
                             "--name", "tiny", "--threads", "1", *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code in (200, 401):
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)


def stop(proc):
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "requests.jsonl"
    proc, url = start(tiny_model_dir, "--log", str(log))
    yield url, log
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_lists_and_completes(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = [{"role": "user", "content": "def add(a, b):\n"}]
    a = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=16, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=16, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content  # greedy repeats
    assert a.choices[0].finish_reason in ("stop", "length") and 0 < a.usage.completion_tokens <= 16
    text = client.completions.create(model="tiny", prompt="def add(a, b):\n", max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 8


def test_streaming_gives_the_same_text_in_pieces(client):
    prompt = [{"role": "user", "content": "def mul(a, b):\n"}]
    whole = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=prompt, max_tokens=24, temperature=0,
                                                 stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_concurrent_requests_are_batched(server, client):
    url, _ = server
    prompt = [{"role": "user", "content": "def sub(a, b):\n"}]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: client.chat.completions.create(model="tiny", messages=prompt, max_tokens=16,
                                                                      temperature=1.0), range(16)))
    assert all(o.usage.completion_tokens > 0 for o in outs)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    sizes = {s.labels["le"]: s.value for s in families["tempering_batch_size"].samples
             if s.name.endswith("_bucket")}
    total = next(s.value for s in families["tempering_batch_size"].samples if s.name.endswith("_count"))
    assert sizes["1.0"] < total  # some generations served more than one request


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="ending with a user turn"):
        client.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def f(x): " * 300}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5)


def test_the_agent_over_http_matches_the_agent_in_process(server, tiny_model_dir, tasks, sandbox):
    url, log = server
    heldout = tasks[1][:6]
    settings = RepairSettings(repairs=2, max_tokens=24)
    remote = repair(HTTPChat(f"{url}/v1"), heldout, EnvContext(sandbox, feedback_chars=200), settings)
    local = LocalChat(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir))
    here = repair(local, heldout, EnvContext(sandbox, feedback_chars=200), settings)
    assert [e.classes for e in remote.episodes] == [e.classes for e in here.episodes]
    assert sum(len(e.classes) for e in remote.episodes) > len(heldout)  # repairs were asked for over HTTP
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    served = sum(s.value for s in families["tempering_requests"].samples
                 if s.name == "tempering_requests_total" and s.labels["endpoint"] == "/v1/chat/completions")
    assert served >= sum(len(e.classes) for e in remote.episodes)
    assert '"endpoint": "/v1/chat/completions"' in log.read_text()  # one JSON line per request


def test_a_server_that_is_down_is_one_clear_error():
    with pytest.raises(TemperingError, match=r"model server at http://127.0.0.1:\d+/v1 is unreachable"):
        HTTPChat(f"http://127.0.0.1:{free_port()}/v1")


def test_off_loopback_needs_a_token_and_a_token_is_enforced(tiny_model_dir):
    refused = subprocess.run([sys.executable, "-m", "tempering.cli", "serve", str(tiny_model_dir), "--host",
                              "192.0.2.1"], capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if not k.startswith("TEMPERING_SERVE")})
    assert refused.returncode == 2 and "without a token" in refused.stderr
    proc, url = start(tiny_model_dir, env={"TEMPERING_SERVE_TOKEN": KEY})
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(TemperingError, match="refused the API key"):
            HTTPChat(f"{url}/v1", api_key="wrong")
        assert openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).models.list().data[0].id == "tiny"
    finally:
        stop(proc)
