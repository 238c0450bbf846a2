"""`tempering.http`: the pieces the sandbox service, `tempering serve` and the HTTP engine share - the
retrying client (against a stand-in server here), and that each of them uses this one module."""

import ast
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tempering.errors import TemperingError
from tempering.http import RetryingClient, Unreachable
from tempering.inference.engine import SamplingParams, make_engine
from tempering.models.loading import load_tokenizer
from tests.helpers.servers import free_port

SRC = Path(__file__).resolve().parents[1] / "src" / "tempering"


class Busy(BaseHTTPRequestHandler):
    """An OpenAI-shaped server that answers its first `busy` completions 429, then token ids."""

    busy, seen = 2, []

    def do_GET(self):
        self.reply(200, {"data": [{"id": "m", "max_model_len": 64}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Busy.seen.append(self.path)
        if len(Busy.seen) <= Busy.busy:
            return self.reply(429, {"error": {"message": "busy"}})
        self.reply(200, {"choices": [{"token_ids": [5, 6], "finish_reason": "length"}]})

    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def busy_server():
    Busy.seen, Busy.busy = [], 2
    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_http_engine_waits_out_a_busy_server(busy_server, tiny_model_dir):
    """A 429 from a loaded `tempering serve` is retried with backoff, not the end of an evaluation."""
    engine = make_engine(
        busy_server, load_tokenizer(tiny_model_dir), SamplingParams(1.0, 1.0, 2), kind="http", backoff_s=0.01
    )
    gen = engine.generate([[1, 2, 3]])
    assert gen.response_ids[0].tolist()[:2] == [5, 6] and Busy.seen == ["/v1/completions"] * 3
    Busy.seen, Busy.busy = [], 9  # busy beyond the retries: one line naming the status
    with pytest.raises(TemperingError, match="completions answered 429"):
        engine.generate([[1, 2, 3]])
    assert len(Busy.seen) == 5


def test_the_retrying_client_says_why_no_answer_came():
    client = RetryingClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01)
    with pytest.raises(Unreachable, match=r"not reachable after 2 attempts \(ConnectError"):
        client.request("GET", "/health")
    client.close()


def test_the_services_serve_and_the_http_engine_share_one_http_module():
    """Token, loopback check, admission, guard and retrying client live in `tempering/http.py` only."""
    users = [
        "sandbox/service.py",
        "sandbox/app.py",
        "agent/server.py",
        "agent/commands.py",
        "inference/remote.py",
    ]
    for rel in users:
        tree = ast.parse((SRC / rel).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "tempering.http" in imported, rel
        assert not {"tempering.sandbox.app", "tempering.sandbox.service"} & imported or rel.startswith(
            "sandbox"
        ), rel
    shared = {"Admission", "Guard", "RetryingClient", "read_token", "is_loopback"}
    for path in SRC.rglob("*.py"):
        defined = {
            n.name
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ClassDef | ast.FunctionDef)
        }
        assert path.name == "http.py" or not shared & defined, path
