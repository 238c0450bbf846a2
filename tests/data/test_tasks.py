import json

import pytest

from tempering.data import load_tasks, save_tasks
from tempering.errors import TaskFileError

GOOD = {
    "id": "t1",
    "domain": "d",
    "prompt": "def f(x):\n",
    "entry_point": "f",
    "tests": [{"input": [1], "output": 2}],
}


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_round_trip(tmp_path, tasks):
    train, _ = tasks
    path = save_tasks(train[:20], tmp_path / "t.jsonl")
    assert load_tasks(path) == train[:20]


def test_malformed_json_names_file_and_line(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), "", '{"id": "t2", "domain": '])
    with pytest.raises(TaskFileError, match=r"t\.jsonl:3: not valid JSON"):
        load_tasks(path)


def test_schema_error_names_line_and_field(tmp_path):
    bad = dict(GOOD, id="t2", tests=[{"output": 2}])
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), json.dumps(bad)])
    with pytest.raises(TaskFileError, match=r"t\.jsonl:2: invalid task: tests\.0.*exactly one of 'input'"):
        load_tasks(path)
    path = write(tmp_path / "u.jsonl", [json.dumps({k: v for k, v in GOOD.items() if k != "prompt"})])
    with pytest.raises(TaskFileError, match=r"u\.jsonl:1: invalid task: prompt: Field required"):
        load_tasks(path)
    path = write(tmp_path / "v.jsonl", [json.dumps(dict(GOOD, colour="red"))])
    with pytest.raises(TaskFileError, match="colour"):
        load_tasks(path)


def test_duplicate_ids_and_empty_files(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), json.dumps(GOOD)])
    with pytest.raises(
        TaskFileError, match="line 2.*duplicate task id 't1' \\(first on line 1\\)|:2: duplicate"
    ):
        load_tasks(path)
    with pytest.raises(TaskFileError, match="holds no tasks"):
        load_tasks(write(tmp_path / "e.jsonl", [""]))
    with pytest.raises(TaskFileError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl")


def test_stage_split_holds_disjoint_functions(tasks):
    from tempering.data import function_key, split_stages

    train, _ = tasks
    sft, rl = split_stages(train, 0.5, seed=3)
    assert len(sft) + len(rl) == len(train)
    assert not {function_key(t) for t in sft} & {function_key(t) for t in rl}
    assert split_stages(train, 0.5, seed=3) == (sft, rl)  # deterministic
    assert split_stages(train, 1.0, seed=3) == (train, train)  # 1.0: both stages see everything
    with pytest.raises(ValueError, match="leaves no tasks"):
        split_stages(train[:1], 0.5, seed=3)


def test_the_validation_subset_takes_the_domains_in_turn():
    from tempering.data.tasks import spread_over_domains
    from tempering.types import Task

    grouped = [Task(id=f"{d}{i}", domain=d, env="answer", prompt="?") for d in "ab" for i in range(3)]
    grouped.append(Task(id="c0", domain="c", env="answer", prompt="?"))
    assert [t.id for t in spread_over_domains(grouped, 5)] == ["a0", "b0", "c0", "a1", "b1"]
    assert [t.id for t in spread_over_domains(grouped, 99)] == ["a0", "b0", "c0", "a1", "b1", "a2", "b2"]


def test_validation_functions_are_held_out_of_the_rest():
    from tempering.data import function_key, hold_out_functions
    from tempering.types import Task

    def task(i, body):  # three tasks of each function
        return Task(
            id=f"t{i}", domain="d", env="answer", prompt="?", metadata={"template": "add", "body": body}
        )

    tasks = [task(i, f"return x + {i % 10}") for i in range(30)]
    rest, held = hold_out_functions(tasks, 4, seed=1)
    held_keys = {function_key(t) for t in held}
    assert len(held) == len(held_keys) == 4  # one task of each of 4 distinct functions
    assert not held_keys & {function_key(t) for t in rest}
    assert len(rest) == 30 - 4 * 3  # every task of a held-out function left the rest
    assert hold_out_functions(tasks, 4, seed=1) == (rest, held)  # deterministic in the seed
    assert hold_out_functions(tasks, 4, seed=2) != (rest, held)
    assert len(hold_out_functions(tasks, 99, seed=1)[0]) == 3  # one function always stays for training
    with pytest.raises(ValueError, match="needs 2 or more training functions, not 1"):
        hold_out_functions(tasks[:1], 4, seed=1)
