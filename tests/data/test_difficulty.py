import json

import pytest

from tempering.data import generate_tasks
from tempering.data.difficulty import family, family_rates, in_range, load_pass_rates, pick_per_family
from tempering.errors import ConfigError
from tempering.types import Task


def test_families_are_templates_for_generated_tasks_and_the_task_itself_otherwise():
    train, _ = generate_tasks(400, 10, seed=3)
    picked = pick_per_family(train, 2)
    counts = {}
    for t in picked:
        counts[family(t)] = counts.get(family(t), 0) + 1
    assert set(counts) == {t.metadata["template"] for t in train} and set(counts.values()) == {2}
    assert picked == [t for t in train if t in picked]  # the tasks' own order
    plain = Task(
        id="leetcode-1",
        domain="leetcode-easy",
        prompt="def f(): ...",
        entry_point="f",
        tests=[{"input": [], "output": 1}],
    )
    assert family(plain) == "leetcode-1"


def test_family_rates_pool_a_familys_tasks():
    train, _ = generate_tasks(200, 10, seed=3)
    a, b = [t for t in train if family(t) == "add"][:2]
    c = next(t for t in train if family(t) == "sort")
    rates = family_rates([a, b, c], {a.id: 4, b.id: 1, c.id: 0}, samples=4)
    assert rates == {
        "add": {"pass_rate": 5 / 8, "pass@k": 1.0, "tasks": 2},
        "sort": {"pass_rate": 0.0, "pass@k": 0.0, "tasks": 1},
    }
    d = next(t for t in train if family(t) == "add" and t.id not in (a.id, b.id))
    rates = family_rates([a, d, c], {a.id: 2, d.id: 0, c.id: 1}, samples=4, key=lambda t: t.domain)
    assert rates["arithmetic"] == {"pass_rate": 2 / 8, "pass@k": 0.5, "tasks": 2}


def test_a_gym_task_s_family_is_its_dataset_and_pass_key_picks_the_rate(tmp_path):
    t = Task(id="gcd-7", domain="gcd", env="reasoning_gym", prompt="?", metadata={"dataset": "gcd"})
    assert family(t) == "gcd"
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"families": {"gcd": {"pass_rate": 0.05, "pass@k": 0.375, "tasks": 8}}}))
    assert load_pass_rates(path) == {"gcd": 0.05}
    assert load_pass_rates(path, "pass@k") == {"gcd": 0.375}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"families": {"gcd": {"pass_rate": 0.05, "tasks": 8}}}))
    with pytest.raises(ConfigError, match="not a pass-rates file .*pass@k"):
        load_pass_rates(old, "pass@k")


def test_in_range_drops_measured_families_outside_and_keeps_unmeasured_ones(tmp_path):
    train, heldout = generate_tasks(300, 60, seed=3)
    path = tmp_path / "rates.json"
    path.write_text(
        json.dumps(
            {
                "families": {
                    "add": {"pass_rate": 0.5, "tasks": 8},
                    "sort": {"pass_rate": 0.0, "tasks": 8},
                    "upper": {"pass_rate": 1.0, "tasks": 8},
                }
            }
        )
    )
    rates = load_pass_rates(path)
    for tasks in (train, heldout):
        kept = {family(t) for t in in_range(tasks, rates, 0.05, 0.95)}
        assert kept == {family(t) for t in tasks} - {"sort", "upper"}
    assert {family(t) for t in in_range(train, rates, 0.0, 1.0)} == {family(t) for t in train}


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("not json", "is not a pass-rates file"),
        ('{"families": {"add": {"rate": 0.5}}}', r"is not a pass-rates file \(KeyError"),
        ("[1, 2]", "is not a pass-rates file"),
    ],
)
def test_a_bad_pass_rates_file_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "rates.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_pass_rates(path)
