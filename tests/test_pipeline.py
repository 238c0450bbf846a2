"""`pipeline.prepare`: inputs outside the config that used to fail only after SFT fail before the run
directory exists."""

import pytest

from tempering.config import build_config
from tempering.errors import TemperingError
from tempering.workspace import prepare
from tests.helpers.runs import CLOSED_URL, closed_port


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "sandbox.python=/nonexistent/python3",
            "sandbox.python: '/nonexistent/python3' is not an executable",
        ),
        ("checkpoint.uri=nosuch://bucket/run", "checkpoint.uri 'nosuch://bucket/run'"),
        (CLOSED_URL, "sandbox.url: sandbox service at http://127.0.0.1:"),
    ],
)
def test_outside_inputs_fail_before_the_run_directory_exists(tmp_path, override, message):
    run_dir = tmp_path / "run"
    override = override.replace("{port}", str(closed_port()))
    with pytest.raises(TemperingError, match=message) as e:
        prepare(build_config({}, [f"run.dir={run_dir}", override]))
    assert "\n" not in str(e.value)
    assert not run_dir.exists()


def _http_server(body: bytes):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_sandbox_url_is_asked_for_its_health_before_anything_is_written(tmp_path):
    server, url = _http_server(b"<html>some other server</html>")
    try:
        with pytest.raises(
            TemperingError, match="sandbox.url: .* did not answer as a tempering sandbox service"
        ):
            prepare(build_config({}, [f"run.dir={tmp_path / 'run'}", f"sandbox.url={url}"]))
    finally:
        server.shutdown()
    assert not (tmp_path / "run").exists()
    server, url = _http_server(b'{"status": "ok"}')  # a healthy service: prepare goes on and writes the run
    try:
        ws = prepare(
            build_config(
                {},
                [
                    f"run.dir={tmp_path / 'run'}",
                    f"sandbox.url={url}",
                    "data.num_train=40",
                    "data.num_heldout=4",
                ],
            )
        )
    finally:
        server.shutdown()
    assert (ws.run_dir / "config.yaml").is_file()


def test_the_cached_evaluation_key_covers_every_setting_that_shapes_the_numbers(tmp_path, tasks):
    """A stored held-out evaluation is reused only for an equal key: each of these changes makes it stale."""
    from types import SimpleNamespace

    from tempering.pipeline import eval_key

    heldout = tasks[1][:4]

    def key(*overrides, held=heldout):
        ws = SimpleNamespace(cfg=build_config({}, list(overrides)), run_dir=tmp_path, heldout_tasks=held)
        return eval_key(ws, tmp_path / "sft" / "model", None, ws.heldout_tasks)

    base = key()
    assert key() == base
    changed = [
        key("env.options.code_instruction='Write Python.'"),
        key("env.max_context=512"),
        key("env.feedback_chars=100"),
        key("env.chat_format=plain"),
        key("run.seed=1"),
        key("sandbox.timeout_s=5"),
        key("sandbox.memory_mb=512"),
        key(held=[heldout[0].model_copy(update={"prompt": heldout[0].prompt + " "}), *heldout[1:]]),
    ]
    assert all(k != base for k in changed)
    assert key("tracking.progress=false") == base  # not a setting of the evaluation
