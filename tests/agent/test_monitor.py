"""The alert rule (once per incident, never for a healthy stream, a real webhook) and the metrics text."""

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tempering.agent.monitor import AlertRule, JsonLog, Metrics


def test_a_burst_of_failures_fires_once():
    fired = []
    rule = AlertRule(fired.append, threshold=0.5, window=20, min_events=10)
    for _ in range(30):
        rule.observe(True)
    for _ in range(40):  # a burst: every request fails
        rule.observe(False)
    assert len(fired) == 1 and fired[0]["failure_rate"] >= 0.5
    for _ in range(30):  # recovery resolves the incident ...
        rule.observe(True)
    assert not rule.firing and len(fired) == 1
    for _ in range(20):  # ... and the next burst is a new one
        rule.observe(False)
    assert len(fired) == 2


def test_a_healthy_stream_never_fires():
    fired, rng = [], random.Random(0)
    rule = AlertRule(fired.append, threshold=0.5, window=50, min_events=10)
    for _ in range(5000):
        rule.observe(rng.random() > 0.1)  # 10% failures
    assert fired == [] and rule.failure_rate < 0.3


def test_a_rate_hovering_at_the_threshold_does_not_flap():
    fired = []
    rule = AlertRule(fired.append, threshold=0.5, window=10, min_events=10)
    for i in range(1000):
        rule.observe(i % 2 == 0)  # exactly 50%: at the threshold, never below half of it
    assert len(fired) == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        AlertRule(print, threshold=1.5)
    with pytest.raises(ValueError, match="min_events"):
        AlertRule(print, window=5, min_events=10)


def test_a_webhook_gets_one_post_per_incident():
    received = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rule = AlertRule(
            f"http://127.0.0.1:{server.server_port}/alert", threshold=0.5, window=10, min_events=5
        )
        for _ in range(50):
            rule.observe(False, endpoint="/v1/chat/completions")
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        server.shutdown()
    assert len(received) == 1
    assert received[0]["rule"] == "failure_rate" and received[0]["endpoint"] == "/v1/chat/completions"


def test_metrics_parse_as_prometheus_text():
    m = Metrics()
    m.requests.labels("/v1/chat/completions", "200").inc(3)
    m.request_seconds.labels("/v1/chat/completions").observe(0.2)
    m.attempts.labels("syntax_error").inc()
    m.success_rate.set(0.75)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert {
        "tempering_requests",
        "tempering_request_seconds",
        "tempering_attempts",
        "tempering_success_rate",
        "tempering_alerts",
    } <= set(families)
    [total] = [s for s in families["tempering_requests"].samples if s.name == "tempering_requests_total"]
    assert total.value == 3 and total.labels == {"endpoint": "/v1/chat/completions", "status": "200"}


def test_json_log_lines_are_whole_under_threads(tmp_path):
    log = JsonLog(tmp_path / "log.jsonl")
    threads = [
        threading.Thread(
            target=lambda k=k: [log.write({"k": k, "i": i, "pad": "x" * 500}) for i in range(100)]
        )
        for k in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(lines) == 400 and all(json.loads(line)["pad"] for line in lines)
