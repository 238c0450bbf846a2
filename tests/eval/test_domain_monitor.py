"""The domain monitor: a scripted fall is alerted and acted on, noise is not, and its state resumes."""

import json
from collections import Counter

import pytest

from tempering.config import load_config
from tempering.data import MixtureSampler
from tempering.envs.answer import generate_answer_tasks
from tempering.eval.monitor import MAX_BOOST, DomainMonitor


@pytest.fixture()
def mixture():
    train, _ = generate_answer_tasks(200, 0, seed=0)
    return MixtureSampler(train, {"arithmetic": 1.0, "countdown": 1.0}, seed=0)


def scores(passed: int, of: int = 16) -> list[float]:
    return [1.0] * passed + [0.0] * (of - passed)


def test_a_domain_that_falls_past_its_interval_is_alerted_and_drawn_more(mixture):
    monitor = DomainMonitor(mixture, boost=2.0)
    assert monitor.observe(10, {"arithmetic": scores(8), "countdown": scores(4)}) == []
    # countdown dips within noise (4 -> 3 of 16); arithmetic falls from 8 to 1 of 16
    [alert] = monitor.observe(20, {"arithmetic": scores(1), "countdown": scores(3)})
    assert (alert.domain, alert.step, alert.best, alert.best_step) == ("arithmetic", 20, 0.5, 10)
    assert alert.interval[1] < 0.5 and alert.weight == 2.0
    assert "arithmetic fell to 6.2%" in alert.line() and "best 50.0% (step 10)" in alert.line()
    assert mixture.weights == {"arithmetic": 2.0, "countdown": 1.0}
    counts = Counter(t.domain for t in mixture.next_batch(3000))
    assert 0.62 < counts["arithmetic"] / 3000 < 0.72  # 2 of 3
    row = monitor.metrics([alert])
    assert row["monitor/alerts"] == 1.0 and row["monitor/arithmetic/alert"] == 1.0
    assert row["monitor/arithmetic/weight"] == 2.0 and "monitor/countdown/alert" not in row


def test_a_fall_while_the_training_reward_holds_is_suspect_and_not_paid_more(mixture):
    """The gcd case: pass@1 falls while the domain's reward stays up (an exploit the verifier pays). More
    of its tasks would pay the exploit more: the alert is marked, the weight left alone."""
    monitor = DomainMonitor(mixture, boost=2.0)
    for _ in range(3):
        monitor.record({"reward/arithmetic/mean": 0.2, "reward/countdown/mean": 0.4})
    monitor.observe(10, {"arithmetic": scores(8), "countdown": scores(8)})
    for _ in range(3):  # arithmetic's reward rises (0.2 -> 0.3), countdown's falls (0.4 -> 0.1)
        monitor.record({"reward/arithmetic/mean": 0.3, "reward/countdown/mean": 0.1, "reward/tests/mean": 9})
    hacked, neglected = monitor.observe(20, {"arithmetic": scores(0), "countdown": scores(0)})
    assert (hacked.domain, hacked.suspect, hacked.weight) == ("arithmetic", True, 1.0)
    assert (neglected.domain, neglected.suspect, neglected.weight) == ("countdown", False, 2.0)
    assert "training reward held: check the reward" in hacked.line()
    row = monitor.metrics([hacked, neglected])
    assert row["monitor/arithmetic/suspect"] == 1.0 and "monitor/countdown/suspect" not in row
    assert mixture.weights == {"arithmetic": 1.0, "countdown": 2.0}


def test_a_domain_still_down_is_raised_again_up_to_the_cap_then_restored(mixture):
    monitor = DomainMonitor(mixture, boost=3.0)
    monitor.observe(1, {"arithmetic": scores(12)})
    weights = [monitor.observe(s, {"arithmetic": scores(2)})[0].weight for s in (2, 3, 4)]
    assert weights == [3.0, MAX_BOOST, MAX_BOOST]
    assert monitor.observe(5, {"arithmetic": scores(11)}) == []  # its interval reaches its best again
    assert mixture.weights["arithmetic"] == 1.0


def test_boost_one_alerts_without_acting_and_below_one_is_refused(mixture):
    monitor = DomainMonitor(mixture, boost=1.0)
    monitor.observe(1, {"countdown": scores(10)})
    assert [a.domain for a in monitor.observe(2, {"countdown": scores(0)})] == ["countdown"]
    assert mixture.weights["countdown"] == 1.0
    with pytest.raises(ValueError, match="at least 1"):
        DomainMonitor(mixture, boost=0.5)


def test_a_resumed_monitor_and_mixture_act_as_the_uninterrupted_ones(mixture):
    """Validation at odd steps; the checkpoint falls after step 2, mid-window (its reward recorded, not yet
    validated). arithmetic falls at 3 while its reward rises (suspect), countdown at 5 with its reward."""
    train, _ = generate_answer_tasks(200, 0, seed=0)
    script = {
        1: {"arithmetic": scores(9), "countdown": scores(6)},
        3: {"arithmetic": scores(0), "countdown": scores(7)},
        5: {"arithmetic": scores(10), "countdown": scores(0)},
    }

    def run(sampler, monitor, steps):
        out = []
        for step in steps:
            out.append([t.id for t in sampler.next_batch(9)])
            monitor.record({"reward/arithmetic/mean": 0.1 * step, "reward/countdown/mean": 0.5 - 0.1 * step})
            if step in script:
                out.append([(a.domain, a.suspect, a.weight) for a in monitor.observe(step, script[step])])
        return out

    straight = run(mixture, DomainMonitor(mixture, 2.0), range(6))
    first = MixtureSampler(train, {"arithmetic": 1.0, "countdown": 1.0}, seed=0)
    first_monitor = DomainMonitor(first, 2.0)
    got = run(first, first_monitor, range(3))
    sampler_state, monitor_state = json.loads(json.dumps([first.state_dict(), first_monitor.state_dict()]))
    assert monitor_state["window"] and monitor_state["reward_at_best"]
    resumed = MixtureSampler(train, {"arithmetic": 1.0, "countdown": 1.0}, seed=0)
    resumed.load_state_dict(sampler_state)
    resumed_monitor = DomainMonitor(resumed, 2.0)
    resumed_monitor.load_state_dict(monitor_state)
    got += run(resumed, resumed_monitor, range(3, 6))
    assert got == straight
    assert [("arithmetic", True, 1.0)] in straight and [("countdown", False, 2.0)] in straight


@pytest.mark.slow
def test_a_run_whose_validation_falls_reports_the_alert_and_raises_the_weight(tmp_path, monkeypatch):
    """A real run (the smoke recipe over a mixture of the six code domains) whose validation is scripted to
    fall in one domain at the second validation: the log line, the row, the weight the next draws use and
    the summary's monitor section."""
    import tempering.loop as loop
    from tempering.pipeline import train

    real = loop.validation_metrics

    def scripted(engine, tasks, ctx, **kw):
        metrics, per_task = real(engine, tasks, ctx, **kw)
        calls.append(sorted(per_task))
        strings = [0.0] * 8 if len(calls) == 2 else [1.0] * 8
        return metrics | {"val/strings/pass@1": sum(strings) / 8}, per_task | {"strings": strings}

    calls: list[list[str]] = []
    monkeypatch.setattr(loop, "validation_metrics", scripted)
    # its training reward falls with it (1.0 before the first validation, 0.0 after): a fall, not an exploit
    real_record = DomainMonitor.record
    monkeypatch.setattr(
        DomainMonitor,
        "record",
        lambda self, m: real_record(self, m | {"reward/strings/mean": 0.0 if calls else 1.0}),
    )
    lines: list[str] = []
    cfg = load_config(
        "configs/smoke.yaml",
        [f"run.dir={tmp_path / 'run'}", "data.mixture={'*': 1.0}", "train.steps=7", "eval.every=3"],
    )
    from tempering import workspace

    monkeypatch.setattr(workspace.Workspace, "log", lambda self, msg: lines.append(msg))
    summary = train(cfg)
    assert len(calls) == 2
    [alert] = summary["monitor"]["alerts"]
    assert (alert["step"], alert["domain"], alert["pass@1"], alert["weight"]) == (6, "strings", 0.0, 2.0)
    assert summary["monitor"]["validations"] == 2 and summary["monitor"]["weights"]["strings"] == 2.0
    assert any(line.startswith("monitor: strings fell to 0.0%") for line in lines)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[5]["monitor/strings/alert"] == 1.0 and rows[2]["monitor/alerts"] == 0.0
