"""The results table: README.md and docs/results/index.md are generated from results/*.json and current."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from datetime import date
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_results = _load("docs_results", ROOT / "tools" / "docs_results.py")
bench_record = _load("bench_record", ROOT / "bench" / "record.py")
RECORDS = sorted((ROOT / "results").glob("*.json"))


def test_generated_files_are_current():
    for path, text in docs_results.outputs().items():
        assert path.read_text() == text, f"{path.name} is stale: run python tools/docs_results.py"
    assert docs_results.main(["--check"]) == 0


def test_every_headline_record_is_in_readme_and_page():
    readme, page = (ROOT / "README.md").read_text(), (ROOT / "docs" / "results" / "index.md").read_text()
    assert RECORDS
    for path in RECORDS:
        record = json.loads(path.read_text())
        assert docs_results._cell(record["figure"]) in readme and record["command"] in page


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.stem)
def test_record_has_every_field(path):
    record = json.loads(path.read_text())
    assert set(record) == set(docs_results.FIELDS)
    assert record["name"] == path.stem
    date.fromisoformat(record["date"])
    assert isinstance(record["value"], (int, float)) and isinstance(record["values"], dict)
    assert all(isinstance(record[f], str) and record[f] for f in ("figure", "unit", "machine", "command"))


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.stem)
def test_record_commit_exists(path):
    commit = json.loads(path.read_text())["commit"]
    done = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    assert done.returncode == 0, f"{path.name}: commit {commit} is not in this repository"


def test_bench_record_writes_the_same_fields(tmp_path):
    assert bench_record.FIELDS == docs_results.FIELDS
    bench_record.write_record(tmp_path / "x.json", name="x", figure="1.5 s", unit="s", value=1.5)
    (record,) = docs_results.load_records(tmp_path)
    assert record["value"] == 1.5 and record["date"] == date.today().isoformat()
    assert record["command"].startswith(".venv/bin/python ")


def test_missing_field_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"name": "bad", "figure": "1 s"}))
    with pytest.raises(ValueError, match="bad.json: missing field"):
        docs_results.load_records(tmp_path)


def test_readme_table_replaces_only_between_markers():
    record = dict.fromkeys(docs_results.FIELDS, "v") | {"figure": "a | b"}
    text = f"intro\n{docs_results.BEGIN}\nold table\n{docs_results.END}\noutro\n"
    new = docs_results.readme_with_table(text, [record])
    assert new.startswith(f"intro\n{docs_results.BEGIN}\n| figure |") and new.endswith(
        f"{docs_results.END}\noutro\n"
    )
    assert "old table" not in new and "a \\| b" in new
    with pytest.raises(ValueError, match="no results markers"):
        docs_results.readme_with_table("no markers", [record])
