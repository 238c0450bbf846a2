"""Monitoring for the deployment side: Prometheus metrics, structured JSON logs, and an alert rule.

`Metrics` holds the counters and histograms of one server or agent in its own registry (so two in one
process do not collide); `render()` is the Prometheus text format `/metrics` answers with.

`AlertRule` watches a stream of outcomes (True = success) and fires when the failure rate over the last
`window` outcomes reaches `threshold` (once at least `min_events` are in the window). It fires once per
incident: the incident lasts until the rate falls to `clear_below` (default half the threshold), so a
burst of failures raises one alert, not one per request, and a rate hovering at the threshold does not
flap. The action is a callable (it gets the alert as a dict) or a webhook URL (POSTed the alert as JSON
in a background thread, so serving never waits on it; a failed POST is logged, not raised).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("tempering.agent")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """What `/metrics` shows. Server: requests by endpoint and status, their latency, tokens in and out.
    Agent: attempts by failure class, episodes by result, attempt latency, the windowed success rate, alerts."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "tempering_requests", "HTTP requests served", ["endpoint", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "tempering_request_seconds",
            "Time to answer a request",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("tempering_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("tempering_completion_tokens", "Tokens generated", registry=r)
        self.cancelled = Counter(
            "tempering_cancelled", "Requests whose client hung up before they were done", registry=r
        )
        self.batch_size = Histogram(
            "tempering_batch_size",
            "Requests generated together",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.attempts = Counter(
            "tempering_attempts", "Agent attempts by outcome class", ["outcome"], registry=r
        )
        self.attempt_seconds = Histogram(
            "tempering_attempt_seconds",
            "Time of one attempt (generation and execution)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.episodes = Counter(
            "tempering_episodes", "Agent episodes by result (solved, failed, stuck)", ["result"], registry=r
        )
        self.success_rate = Gauge("tempering_success_rate", "Success rate over the alert window", registry=r)
        self.alerts = Counter("tempering_alerts", "Alerts fired", ["rule"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AlertRule:
    def __init__(
        self,
        action: Callable[[dict], Any] | str,
        *,
        threshold: float = 0.5,
        window: int = 50,
        min_events: int = 10,
        clear_below: float | None = None,
        name: str = "failure_rate",
        metrics: Metrics | None = None,
    ):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"alert threshold {threshold} is not in (0, 1]")
        if window < 1 or not 1 <= min_events <= window:
            raise ValueError(
                f"alert window {window} / min_events {min_events}: need 1 <= min_events <= window"
            )
        self.action, self.threshold, self.name, self.metrics = action, threshold, name, metrics
        self.min_events = min_events
        self.clear_below = threshold / 2 if clear_below is None else clear_below
        self.outcomes: deque[bool] = deque(maxlen=window)
        self.firing = False
        self.fired = 0
        self._lock = threading.Lock()

    @property
    def failure_rate(self) -> float:
        return self.outcomes.count(False) / len(self.outcomes) if self.outcomes else 0.0

    def observe(self, success: bool, **context: Any) -> dict | None:
        """Record one outcome; returns the alert when this outcome started an incident."""
        with self._lock:
            self.outcomes.append(bool(success))
            rate = self.failure_rate
            if self.metrics:
                self.metrics.success_rate.set(1.0 - rate)
            if self.firing and rate <= self.clear_below:
                self.firing = False
                log.info(json.dumps({"event": "alert_resolved", "rule": self.name, "failure_rate": rate}))
            if self.firing or len(self.outcomes) < self.min_events or rate < self.threshold:
                return None
            self.firing, self.fired = True, self.fired + 1
            alert = {
                "rule": self.name,
                "failure_rate": round(rate, 4),
                "threshold": self.threshold,
                "window": len(self.outcomes),
                "time": time.time(),
                **context,
            }
        if self.metrics:
            self.metrics.alerts.labels(self.name).inc()
        log.warning(json.dumps({"event": "alert", **alert}))
        self._send(alert)
        return alert

    def _send(self, alert: dict) -> None:
        if callable(self.action):
            self.action(alert)
            return
        url = self.action

        def post():
            import httpx

            try:
                httpx.post(url, json=alert, timeout=10.0).raise_for_status()
            except httpx.HTTPError as e:
                log.error(json.dumps({"event": "alert_webhook_failed", "url": url, "error": str(e)}))

        threading.Thread(target=post, name="alert-webhook", daemon=True).start()


class JsonLog:
    """Appends one JSON object per line to a file (each line written whole, under a lock); a None path
    writes nothing."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        line = json.dumps(record, default=str) + "\n"
        with self._lock, self.path.open("a") as f:
            f.write(line)
