"""`tempering report RUN_DIR`: a self-contained HTML page, rendered in headless Chromium to check that it
shows something (the screenshot is kept next to the page)."""

import json
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from tempering.cli import main as cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def fake_run(run_dir):
    """A run directory as the trainer writes it: metrics rows, a summary, a samples file."""
    run_dir.mkdir()
    rows = []
    for step in range(1, 21):
        rows.append(
            {
                "step": step,
                "reward/mean": step / 20,
                "reward/tests/mean": step / 25,
                "reward/format/mean": 0.9,
                "train/pass_rate": step / 30,
                "response_length/mean": 40 - step,
                "actor/entropy": 2 - step / 20,
                "actor/kl_loss": step / 1000,
                "timing_s/gen": 1.0,
                "timing_s/update": 0.5,
                "timing_s/step": 1.6,
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "heldout_pass@1_before": 0.1,
                "heldout_pass@1_after": 0.3,
                "heldout_greedy_pass@1_before": 0.2,
                "heldout_greedy_pass@1_after": 0.35,
                "heldout_tasks": 8,
                "heldout_samples_per_task": 2,
                "temperature": 1.0,
                "rl_steps": 20,
                "per_domain_before": {"lists": 0.1},
                "per_domain_after": {"lists": 0.3},
                "wall_time_s": 12.0,
            }
        )
    )
    (run_dir / "samples").mkdir()
    sample = {
        "task_id": "t1",
        "domain": "lists",
        "reward": 1.0,
        "components": {"tests": 1.0},
        "turns": [{"action": "def f(x):\n    return x <script>alert(1)</script>", "observation": None}],
    }
    (run_dir / "samples" / "step_000020.jsonl").write_text(json.dumps(sample) + "\n")
    return run_dir


def test_the_report_is_one_self_contained_page(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run")
    assert cli(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    assert (
        page.count("data:image/png;base64,") == 8
    )  # held-out bars and validation; reward, pass rate, length, KL,
    # entropy, step time
    assert (
        "http://" not in page and "https://" not in page and "<script>" not in page
    )  # nothing fetched or run
    assert "&lt;script&gt;" in page and "lists" in page and "30.0%" in page
    assert cli(["report", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_the_report_shows_held_out_intervals_and_the_validation_curve(tmp_path):
    """With intervals in the summary: a gain column, bars before/after and the validation curve per domain
    (step 0 the evaluation before RL); per-step curves are smoothed."""
    from tempering.tracking.report import ema

    run_dir = fake_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["step"] % 5 == 0:
            r |= {"val/pass@1": r["step"] / 100, "val/greedy_pass@1": 0.2, "val/lists/pass@1": r["step"] / 90}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((run_dir / "summary.json").read_text())
    block = {"before": [0.05, 0.15], "after": [0.22, 0.38], "gain": [0.2, 0.12, 0.28], "tasks": 8}
    summary["intervals"] = {"sampled": {"all": block, "lists": block}, "greedy": {"all": block}}
    summary["benchmarks"] = {
        "humaneval": {
            "tasks": 164,
            "greedy_pass@1_before": 0.037,
            "greedy_pass@1_after": 0.043,
            "intervals": {**block, "gain": [0.006, -0.012, 0.024]},
        }
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert cli(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    assert (
        'alt="held-out pass@1 before and after RL"' in page and 'alt="held-out pass@1 (validation)"' in page
    )
    assert page.count("data:image/png;base64,") == 8
    assert "+20.0 [+12.0, +28.0]" in page
    assert "humaneval (greedy, 164)</th><th>3.7%</th><th>4.3%</th><td>+0.6 [-1.2, +2.4]</td>" in page
    assert ema([1.0, 1.0, 1.0], 5) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no pull towards 0
    assert ema([0.0, 1.0], 1) == [0.0, 1.0]  # span 1: the raw values


def test_every_metric_of_a_panel_is_drawn_overall_first(tmp_path):
    """A run over 15 domains has 31 reward names: all are drawn, over several figures, reward/mean first."""
    from tempering.tracking.report import LINES_PER_FIGURE, panel_names

    rows = [
        {
            "step": s,
            "reward/mean": s / 10,
            **{f"reward/d{i:02d}/mean": i / 15 for i in range(15)},
            **{f"reward/d{i:02d}/tests/mean": i / 20 for i in range(15)},
        }
        for s in range(1, 4)
    ]
    groups = panel_names(rows, "reward/")
    assert groups[0][0] == "reward/mean"
    assert sorted(n for g in groups for n in g) == sorted(k for k in rows[0] if k != "step")
    assert all(len(g) <= LINES_PER_FIGURE for g in groups) and len(groups) == 4
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and 'alt="reward (4 of 4)"' in page


def test_a_partial_run_is_reported_without_a_traceback(tmp_path, capsys):
    """Killed mid-step: the last metrics line is cut short, no summary yet."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    assert cli(["report", str(run_dir)]) == 0
    assert "1 RL steps recorded" in (run_dir / "report.html").read_text()
    (run_dir / "summary.json").write_text("{not json")
    assert cli(["report", str(run_dir)]) == 2
    assert "summary.json' is not valid JSON" in capsys.readouterr().err


@pytest.mark.slow
def test_the_report_of_a_real_run(smoke_run):  # noqa: F811
    """The files the trainer wrote (tests/test_e2e.py's smoke run): every panel, the per-domain table with
    the summary's own numbers, and a sample completion from the newest samples file."""
    assert cli(["report", str(smoke_run), "--out", str(smoke_run.parent / "report.html")]) == 0
    page = (smoke_run.parent / "report.html").read_text()
    summary = json.loads((smoke_run / "summary.json").read_text())
    assert page.count("data:image/png;base64,") >= 5
    for domain, value in summary["per_domain_after"].items():
        assert f"<td>{domain}</td>" in page and f"{value:.1%}" in page
    newest = sorted((smoke_run / "samples").glob("step_*.jsonl"))[-1]
    assert newest.name in page
    first = json.loads(newest.read_text().splitlines()[0])
    assert str(first["task_id"]) in page


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (`make test` installs Debian's chromium)")
def test_the_report_renders_in_headless_chromium(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    assert cli(["report", str(run_dir)]) == 0
    shot = run_dir / "report.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=1280,1600",
            (run_dir / "report.html").as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert pixels.shape == (1600, 1280)
    assert (pixels < 200).mean() > 0.02  # text and plot lines, not a blank page
    assert len(np.unique(pixels)) > 50  # anti-aliased figures, not a single-colour error page
