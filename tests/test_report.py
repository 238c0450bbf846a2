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
        rows.append({"step": step, "reward/mean": step / 20, "reward/tests/mean": step / 25, "reward/format/mean": 0.9,
                     "train/pass_rate": step / 30, "response_length/mean": 40 - step, "actor/entropy": 2 - step / 20,
                     "actor/kl_loss": step / 1000, "timing_s/gen": 1.0, "timing_s/update": 0.5, "timing_s/step": 1.6})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({
        "heldout_pass@1_before": 0.1, "heldout_pass@1_after": 0.3, "heldout_greedy_pass@1_before": 0.2,
        "heldout_greedy_pass@1_after": 0.35, "heldout_tasks": 8, "heldout_samples_per_task": 2, "temperature": 1.0,
        "rl_steps": 20, "per_domain_before": {"lists": 0.1}, "per_domain_after": {"lists": 0.3}, "wall_time_s": 12.0}))
    (run_dir / "samples").mkdir()
    sample = {"task_id": "t1", "domain": "lists", "reward": 1.0, "components": {"tests": 1.0},
              "turns": [{"action": "def f(x):\n    return x <script>alert(1)</script>", "observation": None}]}
    (run_dir / "samples" / "step_000020.jsonl").write_text(json.dumps(sample) + "\n")
    return run_dir


def test_the_report_is_one_self_contained_page(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run")
    assert cli(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 6  # reward, pass rate, length, KL, entropy, step time
    assert "http://" not in page and "https://" not in page and "<script>" not in page  # nothing fetched or run
    assert "&lt;script&gt;" in page and "lists" in page and "30.0%" in page
    assert cli(["report", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (`make test` installs Debian's chromium)")
def test_the_report_renders_in_headless_chromium(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    assert cli(["report", str(run_dir)]) == 0
    shot = run_dir / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1280,1600", (run_dir / "report.html").as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert pixels.shape == (1600, 1280)
    assert (pixels < 200).mean() > 0.02  # text and plot lines, not a blank page
    assert len(np.unique(pixels)) > 50   # anti-aliased figures, not a single-colour error page
