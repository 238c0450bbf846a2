"""`tempering`'s argument checks: a value out of range is one `error:` line and exit 2, before any task
file, model or worker is touched."""

import subprocess
import sys

import pytest

from tempering import checkpoint
from tempering.cli import build_parser, main
from tempering.sandbox import service

REPAIR = ["repair", "no-such-model", "--tasks", "humaneval"]
EVAL = ["eval", "no-such-model", "--tasks", "humaneval"]

BAD = [
    (REPAIR + ["--repairs", "-1"], "--repairs"),
    (REPAIR + ["--limit", "0"], "--limit"),
    (REPAIR + ["--temperature", "nan"], "--temperature"),
    (REPAIR + ["--temperature", "-1"], "--temperature"),
    (REPAIR + ["--max-tokens", "0"], "--max-tokens"),
    (REPAIR + ["--feedback-chars", "-5"], "--feedback-chars"),
    (REPAIR + ["--concurrency", "0"], "--concurrency"),
    (REPAIR + ["--metrics-port", "99999"], "--metrics-port"),
    (REPAIR + ["--threads", "0"], "--threads"),
    (REPAIR + ["--max-context", "0"], "--max-context"),
    (EVAL + ["--k", "0"], "--k"),
    (EVAL + ["--k", "1,-2"], "--k"),
    (EVAL + ["--k", "one"], "--k"),
    (EVAL + ["--samples", "0"], "--samples"),
    (EVAL + ["--limit", "-1"], "--limit"),
    (EVAL + ["--temperature", "inf"], "--temperature"),
    (EVAL + ["--max-new-tokens", "0"], "--max-new-tokens"),
    (EVAL + ["--turns", "0"], "--turns"),
    (EVAL + ["--max-context", "-1"], "--max-context"),
    (EVAL + ["--threads", "0"], "--threads"),
    (["sandbox", "serve", "--max-timeout-s", "-1"], "--max-timeout-s"),
    (["sandbox", "serve", "--max-timeout-s", "nan"], "--max-timeout-s"),
    (["sandbox", "serve", "--port", "99999"], "--port"),
    (["sandbox", "serve", "--port", "0"], "--port"),
    (["sandbox", "serve", "--workers", "0"], "--workers"),
    (["sandbox", "serve", "--max-pending", "0"], "--max-pending"),
    (["sandbox", "serve", "--client-pending", "-1"], "--client-pending"),
    (["sandbox", "serve", "--client-concurrency", "0"], "--client-concurrency"),
    (["sandbox", "serve", "--max-request-mb", "0"], "--max-request-mb"),
    (["sandbox", "serve", "--max-memory-mb", "-1"], "--max-memory-mb"),
    (["sandbox", "run", "prog.py", "--timeout", "-1"], "--timeout"),
    (["sandbox", "run", "prog.py", "--memory-mb", "0"], "--memory-mb"),
    (["data", "from-logs", "log.jsonl", "--out", "tasks.jsonl", "--max-failing", "0"], "--max-failing"),
]


@pytest.fixture()
def nothing_starts(monkeypatch):
    """A command that got past its arguments fails the test at once (instead of loading or serving)."""

    def started(*args, **kwargs):
        raise AssertionError("the command started working")

    monkeypatch.setattr(checkpoint, "resolve_model", started)
    monkeypatch.setattr(service, "serve", started)


@pytest.mark.parametrize("argv, option", BAD, ids=[" ".join(a[:2] + a[-2:]) for a, _ in BAD])
def test_an_out_of_range_value_is_one_error_line(argv, option, capsys, nothing_starts):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert f"argument {option}: expected" in err and repr(argv[-1]) in err


def test_values_in_range_are_parsed():
    args = build_parser().parse_args(EVAL + ["--k", "5,1,5", "--samples", "5", "--temperature", "0"])
    assert args.k == (1, 5) and args.samples == 5 and args.temperature == 0.0
    assert build_parser().parse_args(EVAL).k == (1,)  # the default goes through the same check
    args = build_parser().parse_args(["sandbox", "serve", "--max-timeout-s", "0.5", "--port", "65535"])
    assert (args.max_timeout_s, args.port) == (0.5, 65535)
    assert build_parser().parse_args(REPAIR + ["--repairs", "0"]).repairs == 0


def test_the_command_line_gets_the_one_line_error():
    """End to end: the sandbox service is never started (it would serve until killed)."""
    done = subprocess.run(
        [sys.executable, "-m", "tempering.cli", "sandbox", "serve", "--max-timeout-s", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "error: tempering sandbox serve: argument --max-timeout-s: expected a finite number > 0, not '-1'\n"
    )


def test_version_is_the_installed_packages(capsys):
    import importlib.metadata

    import tempering

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"tempering {tempering.__version__}\n"
    assert importlib.metadata.version("tempering") == tempering.__version__  # pyproject reads it from there
