"""The deployment side's commands from the command line: `tempering repair`, and the run settings a
model brings along (read only from the run or checkpoint the model belongs to)."""

import json
import shutil
import sys

import pytest
import yaml

from tempering.agent.commands import run_settings
from tempering.cli import main as cli
from tempering.data import save_tasks
from tempering.errors import TemperingError

ENV = {
    "feedback_chars": 99,
    "max_context": 333,
    "chat_format": "plain",
    "options": {"code_instruction": "Solve:"},
}


def settings(env) -> dict:
    return {
        "feedback_chars": env.feedback_chars,
        "code_instruction": env.options.code_instruction,
        "chat_format": env.chat_format,
        "max_context": env.max_context,
    }


SETTINGS = {"feedback_chars": 99, "code_instruction": "Solve:", "chat_format": "plain", "max_context": 333}


def fake_run(root, tiny_model_dir):
    """A run directory as the trainer leaves it: config.yaml, data/, sft/model, one checkpoint."""
    run = root / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "heldout.jsonl").write_text("")
    (run / "config.yaml").write_text(yaml.safe_dump({"env": ENV}))
    shutil.copytree(tiny_model_dir, run / "sft" / "model")
    step = run / "checkpoints" / "step_000001"
    shutil.copytree(tiny_model_dir, step / "model")
    (step / "config.yaml").write_text(yaml.safe_dump({"env": {**ENV, "feedback_chars": 98}}))
    (step / "MANIFEST.json").write_text(json.dumps({"files": {}}))
    return run


def test_run_settings_come_from_the_models_own_run_only(tmp_path, tiny_model_dir, monkeypatch):
    run = fake_run(tmp_path, tiny_model_dir)
    assert settings(run_settings(run / "sft" / "model")) == SETTINGS
    assert run_settings(run / "checkpoints" / "step_000001" / "model").feedback_chars == 98
    # A config.yaml that merely lies nearby - the model's parent, the working directory - is someone else's:
    # it is not read, and nothing it names is imported.
    other = tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dir, other / "model")
    (other / "config.yaml").write_text(
        yaml.safe_dump({"env": {"feedback_chars": 77}, "reward": {"weights": {"evil_module_xyz:score": 1.0}}})
    )
    monkeypatch.chdir(other)
    assert run_settings(other / "model") is None and run_settings(tmp_path / "elsewhere" / "model") is None
    assert "evil_module_xyz" not in sys.modules


def test_run_settings_are_read_as_load_config_reads_a_config(tmp_path, tiny_model_dir):
    """The run's config.yaml is a config like any other: its `base:` is followed, and a wrong key or type in
    any section is a one-line error naming the file and the key - while user code it names is not imported."""
    run = fake_run(tmp_path, tiny_model_dir)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"env": ENV}))
    (run / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "base": "../recipe.yaml",
                "env": {"feedback_chars": 97},
                "reward": {"weights": {"evil_module_xyz:score": 1.0}},
            }
        )
    )
    assert settings(run_settings(run / "sft" / "model")) == {**SETTINGS, "feedback_chars": 97}
    assert "evil_module_xyz" not in sys.modules
    (run / "config.yaml").write_text(yaml.safe_dump({"env": ENV, "rollout": {"temprature": 1.0}}))
    with pytest.raises(TemperingError, match="config.yaml'.*unknown config key 'rollout.temprature'"):
        run_settings(run / "sft" / "model")


def test_the_repair_command_uses_its_models_run_settings_and_logs_every_attempt(
    tmp_path, tiny_model_dir, tasks, capsys
):
    run = fake_run(tmp_path, tiny_model_dir)
    task_file = tmp_path / "tasks.jsonl"
    save_tasks(tasks[1][:3], task_file)
    log, out = tmp_path / "attempts.jsonl", tmp_path / "summary.json"
    assert (
        cli(
            [
                "repair",
                str(run / "sft" / "model"),
                "--tasks",
                str(task_file),
                "--repairs",
                "1",
                "--max-tokens",
                "8",
                "--log",
                str(log),
                "--out",
                str(out),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    assert summary["tasks"] == 3 and json.loads(capsys.readouterr().out)["tasks"] == 3
    attempts = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(attempts) == round(summary["attempts/mean"] * 3) and len(attempts) >= 3
    # The run's env.feedback_chars (99, not the default 400) cut the longest feedback in the middle.
    assert any("chars cut" in (a["feedback"] or "") for a in attempts)
    assert {a["task_id"] for a in attempts} == {t.id for t in tasks[1][:3]}


def test_repair_command_errors_are_one_line(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "tests.json").write_text("[]")
    for argv, message in [
        (
            ["--prompt", "@/nonexistent/prompt.txt", "--tests", str(tmp_path / "tests.json")],
            "--prompt '@/nonexistent/prompt.txt': cannot read the file",
        ),
        (["--prompt", "x", "--tests", str(tmp_path / "missing.json")], "--tests"),
        (["--tasks", str(tmp_path / "none.jsonl")], "none.jsonl"),
    ]:
        assert cli(["repair", str(tiny_model_dir), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert cli(["repair", str(tiny_model_dir), "--prompt", "x", "--tests", str(tmp_path / "tests.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tests") and "needs at least one test" in err and err.count("\n") == 1, err
    (tmp_path / "tests.json").write_text(json.dumps([{"input": [1], "output": 2}]))
    assert (
        cli(
            [
                "repair",
                str(tmp_path / "no-model"),
                "--prompt",
                "x",
                "--tests",
                str(tmp_path / "tests.json"),
                "--entry-point",
                "f",
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_an_api_key_never_goes_over_plain_http_to_another_host(monkeypatch, tmp_path, capsys, tiny_model_dir):
    """Refused before any connection is made (192.0.2.1 is a documentation address: nothing is sent)."""
    import pytest

    from tempering.errors import TemperingError
    from tempering.inference.engine import make_engine

    monkeypatch.setenv("OPENAI_API_KEY", "sk-" + "x" * 30)
    with pytest.raises(
        TemperingError,
        match=r"refusing to send the API key \(\$OPENAI_API_KEY\) in plain text to "
        r"192.0.2.1: use an https URL, a loopback address, or --allow-insecure-http",
    ):
        make_engine("http://192.0.2.1:8000/v1", None, kind="http")
    (tmp_path / "tests.json").write_text(json.dumps([{"input": [1], "output": 2}]))
    assert (
        cli(
            [
                "repair",
                "http://192.0.2.1:8000/v1",
                "--prompt",
                "x",
                "--tests",
                str(tmp_path / "tests.json"),
                "--entry-point",
                "f",
                "--tokenizer",
                str(tiny_model_dir),
            ]
        )
        == 2
    )
    assert "refusing to send the API key" in capsys.readouterr().err


def test_serve_refuses_an_open_address_without_a_token_before_loading_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TEMPERING_SERVE_TOKEN", raising=False)
    monkeypatch.delenv("TEMPERING_SERVE_TOKEN_FILE", raising=False)
    assert cli(["serve", str(tmp_path / "no-such-model"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "without a token" in err and "does not exist" not in err  # the model was never looked at


def test_every_command_that_takes_a_model_takes_a_registry_name(tmp_path, tiny_model_dir, tasks, monkeypatch):
    """`tempering eval smollm2-135m-instruct` resolves the name as serve and repair do (the registry's
    preparation stands in for the 540 MB conversion here)."""
    from tempering.models import registry

    monkeypatch.setattr(registry, "prepare", lambda name, *a, **kw: tiny_model_dir)
    task_file = tmp_path / "tasks.jsonl"
    save_tasks(tasks[1][:2], task_file)
    out = tmp_path / "eval.json"
    assert (
        cli(
            [
                "eval",
                "smollm2-135m-instruct",
                "--tasks",
                str(task_file),
                "--samples",
                "1",
                "--max-new-tokens",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["model"] == str(tiny_model_dir)
    assert cli(["export", "smollm2-135m-instruct", "--to", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "config.json").is_file()
