"""End-to-end runs of the smoke recipe through the `tempering` command."""

import json

import pytest

from tests.helpers.runs import (
    CLOSED_URL,
    closed_port,
    kill_after_checkpoint,
    metrics,
    stable,
    tempering,
    train_tiny,
    versions,
)


@pytest.mark.slow
def test_train_ends_with_the_paths_of_what_it_wrote(smoke_run):
    """The last thing `tempering train` prints: where the summary, the HTML report and the plot are (the
    table is on stderr with the progress), not the summary's JSON."""
    lines = (smoke_run.parent / "train.stdout").read_text().splitlines()
    assert lines == [
        f"summary  {smoke_run / 'summary.json'}",
        f"report   {smoke_run / 'report.html'}",
        f"plot     {smoke_run / 'plot.png'}",
    ]
    assert (smoke_run / "report.html").read_text().startswith("<!doctype html>")


@pytest.mark.slow
def test_smoke_run_writes_the_run_directory(smoke_run):
    summary = json.loads((smoke_run / "summary.json").read_text())
    for key in (
        "heldout_pass@1_before",
        "heldout_pass@1_after",
        "heldout_greedy_pass@1_before",
        "heldout_greedy_pass@1_after",
        "wall_time_s",
    ):
        assert 0 <= summary[key] <= (1 if "pass" in key else 1e6)
    rows = metrics(smoke_run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for key in (
        "reward/mean",
        "reward/std",
        "reward/tests/mean",
        "reward/format/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "critic/advantages/mean",
        "response_length/mean",
        "response_length/clip_ratio",
        "timing_s/gen",
        "timing_s/reward",
        "timing_s/update",
        "timing_s/step",
        "perf/tokens_per_s",
    ):
        assert key in rows[0], key
    assert "val/pass@1" in rows[2] and "val/greedy_pass@1" in rows[2]
    assert (smoke_run / "checkpoints" / "LATEST").read_text().strip() == "step_000006"
    assert len(list((smoke_run / "samples").glob("step_*.jsonl"))) == 6
    assert list((smoke_run / "tb").glob("events.out.tfevents.*"))
    assert (smoke_run / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert "seed: 0" in (smoke_run / "config.yaml").read_text()
    assert (smoke_run / "checkpoints" / "step_000006" / "config.yaml").read_text() == (
        smoke_run / "config.yaml"
    ).read_text()


@pytest.mark.slow
def test_rl_changes_the_policy(smoke_run):
    from safetensors.torch import load_file

    before = load_file(smoke_run / "sft" / "model" / "model.safetensors")
    after = load_file(smoke_run / "checkpoints" / "step_000006" / "model" / "model.safetensors")
    assert any((before[k] != after[k]).any() for k in before)


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_gives_identical_metrics(smoke_run, tmp_path):
    """The uninterrupted smoke run is the reference; a second run is SIGKILLed right after checkpoint 2."""
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(run_dir, 2)
    assert not (run_dir / "summary.json").exists()
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}")
    assert stable(metrics(run_dir)) == stable(metrics(smoke_run))
    assert (
        json.loads((run_dir / "summary.json").read_text())["heldout_pass@1_after"]
        == json.loads((smoke_run / "summary.json").read_text())["heldout_pass@1_after"]
    )


@pytest.mark.slow
def test_every_sample_row_carries_the_policy_version_that_sampled_it(smoke_run, tmp_path):
    """Step s samples with the weights of the update after step s-1: version s-1 in every row - also in a
    run killed after a checkpoint and resumed (the engine's version comes back from the checkpoint)."""
    assert versions(smoke_run) == {s: {s - 1} for s in range(1, 7)}
    run_dir = tmp_path / "killed"
    kill_after_checkpoint(run_dir, 4)
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}")
    assert versions(run_dir) == {s: {s - 1} for s in range(1, 7)}


@pytest.mark.slow
def test_rerunning_a_finished_run_changes_nothing(smoke_run):
    before = (smoke_run / "metrics.jsonl").read_text()
    tempering("train", smoke_run)  # a run directory as the config argument
    assert (smoke_run / "metrics.jsonl").read_text() == before


def test_bad_inputs_fail_with_one_line_and_lose_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep me")
    bad_tasks = tmp_path / "tasks.jsonl"
    bad_tasks.write_text(
        '{"id": "a", "domain": "d", "prompt": "p", "tests": [{"input": [1], "output": 1}], '
        '"entry_point": "f"}\n{"id": "b"\n'
    )
    cases = [
        (["algo.lrr=1"], "unknown config key 'algo.lrr'"),
        (["model.path=/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
        ([f"data.train_file={bad_tasks}"], f"{bad_tasks}:2: not valid JSON"),
        (["algo.estimator=nope"], "algo.estimator: unknown name 'nope'"),
    ]
    for overrides, message in cases:
        proc = tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *overrides, check=False)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr
        assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, no traceback
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "reward.params={tests: {edge_wieght: 2.0}}",
            "reward.params.tests: unknown parameter(s) edge_wieght",
        ),
        (
            "algo.estimator=no_such_pkg.adv:fn",
            "algo.estimator: advantage estimator 'no_such_pkg.adv:fn': cannot import",
        ),
        ("checkpoint.every=0", "config key 'checkpoint.every'"),
        ("env.options.flaky_failure_rat=0.5", "unknown config key 'env.options.flaky_failure_rat'"),
        (CLOSED_URL, "sandbox.url: sandbox service at http://127.0.0.1:"),
    ],
)
def test_late_config_errors_fail_before_the_run_directory_exists(tmp_path, override, message):
    """Each of these used to pass load time and fail after SFT and the held-out evaluation (or, for the
    sandbox URL, after config.yaml and data/ were written)."""
    run_dir = tmp_path / "run"
    override = override.replace("{port}", str(closed_port()))
    proc = tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", override, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not run_dir.exists()


def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def evaluated_step(run_dir):
    return json.loads((run_dir / "eval_after.json").read_text())["evaluated"]["step"]


@pytest.mark.slow
def test_more_steps_on_a_finished_run_evaluates_the_new_model(tmp_path):
    run_dir = tmp_path / "run"
    train_tiny(run_dir, "train.steps=2")
    assert evaluated_step(run_dir) == 2 and summary_of(run_dir)["rl_step_evaluated"] == 2
    first = (run_dir / "eval_after.json").read_text()
    train_tiny(run_dir, "train.steps=4")  # train.steps may change on resume
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    after = json.loads((run_dir / "eval_after.json").read_text())
    assert (run_dir / "eval_after.json").read_text() != first
    assert after["evaluated"]["step"] == 4 and after["evaluated"]["model"] == "checkpoints/step_000004/model"
    summary = summary_of(run_dir)
    assert summary["rl_step_evaluated"] == 4 and summary["rl_steps"] == 4
    assert summary["heldout_pass@1_after"] == after["sampled"]["overall"]["pass@1"]
    assert summary["config_changes"][0]["changed"]["train.steps"] == {"old": 2, "new": 4}
    assert summary["config_changes"][0]["forced"] == []
    # Nothing changed: the evaluation is reused, not redone.
    train_tiny(run_dir, "train.steps=4")
    assert json.loads((run_dir / "eval_after.json").read_text()) == after


@pytest.mark.slow
def test_the_same_command_on_a_finished_run_records_no_change_and_rewrites_nothing(tmp_path):
    """run.device `auto` is resolved (cpu here) before the config is compared with the recorded one."""
    run_dir = tmp_path / "run"
    train_tiny(run_dir, "train.steps=2")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = train_tiny(run_dir, "train.steps=2")
    assert "config changed" not in proc.stderr
    assert not (run_dir / "config_history").exists() and "config_changes" not in summary_of(run_dir)
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    summary = run_dir / "summary.json"  # its wall_time_s is this invocation's (and report.html shows it)
    redone = {summary, run_dir / "report.html"}
    assert {p: b for p, b in after.items() if p not in redone} == {
        p: b for p, b in before.items() if p not in redone
    }
    assert {k: v for k, v in json.loads(before[summary]).items() if k != "wall_time_s"} == {
        k: v for k, v in summary_of(run_dir).items() if k != "wall_time_s"
    }


@pytest.mark.slow
def test_a_run_stopped_by_max_time_is_evaluated_again_when_continued(tmp_path):
    run_dir = tmp_path / "run"
    proc = train_tiny(run_dir, "train.steps=3", "train.max_time_s=0.001")
    assert "RL stopped at step 1 of 3" in proc.stderr
    assert evaluated_step(run_dir) == 1
    summary = summary_of(run_dir)
    assert summary["rl_step_evaluated"] == 1 and summary["rl_steps_planned"] == 3
    train_tiny(run_dir, "train.steps=3")
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    assert evaluated_step(run_dir) == 3 and summary_of(run_dir)["rl_step_evaluated"] == 3


@pytest.mark.slow
def test_a_changed_config_on_resume_is_refused_unless_the_flag_is_given(tmp_path):
    run_dir = tmp_path / "run"
    train_tiny(run_dir, "train.steps=2")
    snapshot = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = train_tiny(run_dir, "train.steps=3", "algo.lr=5e-4", "rollout.group_size=2", check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "algo.lr 0.0001 -> 0.0005" in proc.stderr and "rollout.group_size 4 -> 2" in proc.stderr
    assert "--allow-config-change" in proc.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == snapshot  # untouched

    old_config = (run_dir / "config.yaml").read_text()
    proc = train_tiny(run_dir, "train.steps=3", "algo.lr=5e-4", "--allow-config-change")
    assert "accepted with --allow-config-change" in proc.stderr
    assert "lr: 0.0005" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "config_history" / "0001.yaml").read_text() == old_config
    [change] = summary_of(run_dir)["config_changes"]
    assert change["forced"] == ["algo.lr"] and change["allowed_by_flag"] is True
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3] and evaluated_step(run_dir) == 3
    # The accepted config is now the run's: the same command needs no flag again.
    train_tiny(run_dir, "train.steps=3", "algo.lr=5e-4")


@pytest.mark.slow
def test_eval_command_on_a_checkpoint(smoke_run, tmp_path):
    out = tmp_path / "eval.json"
    proc = tempering(
        "eval",
        smoke_run / "checkpoints" / "step_000006",
        "--tasks",
        smoke_run / "data" / "heldout.jsonl",
        "--samples",
        "3",
        "--k",
        "1,2",
        "--out",
        out,
    )
    report = json.loads(out.read_text())
    assert report["num_tasks"] == 24 and set(report["overall"]) == {"pass@1", "pass@2"}
    assert "arithmetic" in proc.stdout and "pass@2" in proc.stdout


def test_sandbox_run_prints_exec_result_json(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("print(input() * 2)")
    stdin = tmp_path / "in.txt"
    stdin.write_text("ab\n")
    proc = tempering("sandbox", "run", prog, "--stdin", stdin, "--json")
    result = json.loads(proc.stdout)
    assert result["status"] == "ok" and result["stdout"] == "abab\n"
    for key in (
        "exit_code",
        "signal",
        "stderr",
        "stdout_truncated",
        "stderr_truncated",
        "wall_time_s",
        "cpu_time_s",
        "max_rss_mb",
        "tests",
    ):
        assert key in result
    prog.write_text("while True: pass")
    proc = tempering("sandbox", "run", prog, "--timeout", "0.3", "--json", check=False)
    assert proc.returncode == 1 and json.loads(proc.stdout)["status"] == "timeout"


@pytest.mark.slow
def test_pass_rates_choose_the_tasks_and_benchmarks_are_evaluated_before_and_after(tmp_path, tiny_model_dir):
    rates = tmp_path / "rates.json"
    proc = tempering("data", "pass-rates", "configs/smoke.yaml", "--out", rates, check=False)
    assert proc.returncode == 2 and "names no start model" in proc.stderr and not rates.exists()
    tempering(
        "data",
        "pass-rates",
        "configs/smoke.yaml",
        f"model.path={tiny_model_dir}",
        "data.describe=true",
        "--per-family",
        "1",
        "--samples",
        "2",
        "--out",
        rates,
    )
    measured = json.loads(rates.read_text())
    assert measured["samples"] == 2 and len(measured["families"]) == 47
    assert {f["tasks"] for f in measured["families"].values()} == {1}
    assert len(measured["domains"]) == 6 and sum(d["tasks"] for d in measured["domains"].values()) == 47
    # A random tiny model solves nothing: a range above 0 leaves nothing to train on - one line, nothing written.
    run_dir = tmp_path / "run"
    proc = train_tiny(run_dir, f"data.pass_rates={rates}", "data.pass_range=[0.5, 1.0]", check=False)
    assert (
        proc.returncode == 2 and "data.pass_range: [0.5, 1.0] leaves no training task (0 of 47" in proc.stderr
    )
    assert not run_dir.exists()

    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"families": {"add": {"pass_rate": 0.5}, "sort": {"pass_rate": 0.0}}}))
    proc = train_tiny(
        run_dir,
        f"model.path={tiny_model_dir}",
        "sft.steps=0",
        "train.steps=1",
        "data.describe=true",
        f"data.pass_rates={hand}",
        "data.pass_range=[0.1, 1.0]",
        "eval.benchmarks=[humaneval]",
    )
    train = [json.loads(line) for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    templates = {t["metadata"]["template"] for t in train}
    assert "sort" not in templates and "add" in templates and len(templates) > 30  # unmeasured families stay
    assert all('"""Return ' in t["prompt"] for t in train)
    bench = summary_of(run_dir)["benchmarks"]["humaneval"]
    assert bench["tasks"] == 164 and bench["intervals"]["tasks"] == 164
    for when in ("before", "after"):
        stored = json.loads((run_dir / f"humaneval_{when}.json").read_text())
        assert "sampled" not in stored and stored["greedy"]["num_tasks"] == 164
        assert bench[f"greedy_pass@1_{when}"] == stored["greedy"]["overall"]["pass@1"]
    assert "humaneval (greedy, 164)" in proc.stdout + proc.stderr
