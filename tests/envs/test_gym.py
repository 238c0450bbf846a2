"""The reasoning-gym adapter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from tempering.envs import EnvContext, make_env  # noqa: E402
from tempering.envs.gym import gym_datasets, gym_tasks, score_gym_answer  # noqa: E402
from tempering.types import Task  # noqa: E402


def test_more_than_a_hundred_task_families_are_available():
    assert len(gym_datasets()) >= 100 and "composite" not in gym_datasets()


def test_tasks_survive_a_task_file_and_score_with_their_verifier():
    names = ["basic_arithmetic", "game_of_life_halting", "arc_1d", "spell_backward", "list_functions"]
    train, heldout = gym_tasks(names, 3, 1, seed=0, max_prompt_chars=5000)
    assert {t.domain for t in train} == set(names)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    for task in train:
        task = Task.model_validate(json.loads(task.model_dump_json()))  # as read back from JSONL
        assert score_gym_answer(task, str(task.answer)) == 1.0, task.domain
        assert score_gym_answer(task, "zzz") == 0.0, (
            task.domain
        )  # game_of_life_halting's own verifier says 1.0


def test_generation_is_deterministic_even_for_global_random_users():
    a, _ = gym_tasks(["list_functions", "chain_sum"], 2, 1, seed=3, max_prompt_chars=5000)
    b, _ = gym_tasks(["list_functions", "chain_sum"], 2, 1, seed=3, max_prompt_chars=5000)
    assert [t.prompt for t in a] == [t.prompt for t in b]


def _tasks_in_a_process(hash_seed: str, call: str) -> list:
    """The tasks `call` returns (train + held-out), in a fresh interpreter with PYTHONHASHSEED=hash_seed."""
    code = (
        "import json; from tempering.envs.gym import gym_tasks, _generate\n"
        f"train, heldout = {call}\n"
        "print('@@' + json.dumps([t.model_dump() for t in train + heldout]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("@@"))[2:])


def test_generators_that_iterate_over_sets_give_the_same_tasks_in_every_process():
    names = ["isomorphic_strings", "ransom_note", "knight_swap"]
    # In-process, those generators follow the process's string hashing (why the adapter uses a child)...
    direct = f"_generate({names}, 3, 1, 0, {{}}, 5000)"
    fixed = _tasks_in_a_process("0", direct)
    assert _tasks_in_a_process("1", direct) != fixed
    # ... and gym_tasks in a process with other hashing gets the tasks of PYTHONHASHSEED=0.
    got = _tasks_in_a_process("1", f"gym_tasks({names}, 3, 1, seed=0, max_prompt_chars=5000)")
    assert got == fixed and len(got) == 12 and {t["domain"] for t in got} == set(names)


def test_gym_env_scores_the_answer_and_allows_retries():
    [task], _ = gym_tasks(["basic_arithmetic"], 1, 0, seed=0)
    env = make_env(task, EnvContext(max_turns=2))
    env.reset(task)
    first = env.step("Answer: 123456789")
    assert not first.done and first.rewards == {"correct": 0.0} and "incorrect" in first.observation
    second = env.step(f"<answer>{task.answer}</answer>")
    assert second.done and second.success


def test_an_unknown_dataset_is_named():
    with pytest.raises(ValueError, match="nope"):
        gym_tasks(["nope"], 1, 1, seed=0)


def test_a_multi_line_answer_scores_in_full():
    [task], _ = gym_tasks(["rotate_matrix"], 1, 0, seed=0)
    assert "\n" in str(task.answer)
    env = make_env(task, EnvContext(max_turns=1))
    env.reset(task)
    assert env.step(str(task.answer)).rewards == {"correct": 1.0}


# ------------------------------------------------------------------ verifiers run in the sandbox


def one_task(name):
    [task], _ = gym_tasks([name], 1, 0, seed=0, max_prompt_chars=100_000)
    return task


def crafted_answers(target):
    """Answers to string_insertion, whose verifier runs `eval(answer)` on anything but the exact answer."""
    return [
        f"__import__('os').system('touch {target}')",
        f"open('{target}', 'w').write('pwned')",
        f"[c for c in open('{target}', 'w').write('pwned') or 'x']",
        f"(lambda: 0).__globals__['__builtins__']['open']('{target}', 'w')",
        f"(x for x in [1]).gi_frame.f_globals.get('os').system('touch {target}')",
        # forge this answer's own result on the worker's result channel, then leave before the real one
        '__import__(\'os\').write(3, b\'{"i": 0, "ok": true, "value": "1.0"}\\n{"event": "done"}\\n\') '
        "and __import__('os')._exit(0)",
        '__import__(\'os\').write(3, b\'{"i": 0, "ok": true, "value": "1.0"}\\n\')',
    ]


@pytest.mark.parametrize("isolation", ["auto", "process"])
def test_a_crafted_answer_runs_nothing_on_the_host_and_scores_zero(isolation, tmp_path):
    from tempering.envs.gym import verifier_pool

    task = one_task("string_insertion")
    pool = verifier_pool() if isolation == "auto" else verifier_pool(isolation, 1)  # auto: the shared default
    targets = [
        tmp_path / "pwned",
        Path("/root") / f"pwned-{os.getpid()}",
        Path("/tmp") / f"pwned-{os.getpid()}",
    ]
    for target in targets:
        for answer in crafted_answers(target):
            assert score_gym_answer(task, answer, pool) == 0.0, answer
            assert not target.exists(), answer
    assert score_gym_answer(task, str(task.answer), pool) == 1.0  # the pool still scores normally


def test_answers_score_as_their_verifier_says_in_the_sandbox():
    from tempering.envs.gym import score_gym_answers

    insertion, spiral = one_task("string_insertion"), one_task("spiral_matrix")
    items = [
        (insertion, str(insertion.answer)),
        (insertion, str(list(str(insertion.answer)))),  # eval'd: 0.1
        (spiral, str(spiral.answer)),
        (spiral, str(spiral.answer.split())),
        (spiral, "1 2 3"),
    ]
    expected = [1.0, 0.1, 1.0, 0.1, 0.0]
    for name in [
        "countdown",
        "simple_integration",
        "polynomial_multiplication",
        "arc_1d",
        "arc_agi",
        "game_of_life_halting",
        "basic_arithmetic",
    ]:  # sympy's parse_expr, tuples from JSON, host-checked
        task = one_task(name)
        items += [(task, str(task.answer)), (task, "zzz")]
        expected += [1.0, 0.01 if name == "countdown" else 0.0]  # countdown: format credit
    assert score_gym_answers(items) == pytest.approx(expected)


def test_an_answer_that_contains_the_oracle_earns_nothing_unless_it_is_the_oracle():
    """reasoning-gym's base scorer gives len(oracle) / len(answer) for containing it: a policy learned to
    answer "21" to every GCD question (0.5 on each GCD of 1 or 2). The 33 datasets that use it score
    exact matches only; datasets with their own scorer keep it (string_insertion's partial credit above)."""
    from tempering.envs.gym import score_gym_answers

    [task], _ = gym_tasks(["gcd"], 1, 0, seed=0)
    task.metadata["entry"]["answer"] = task.answer = "1"
    ratio = next(t for t in gym_tasks(["course_schedule"], 4, 0, seed=0)[0])
    other = "False" if ratio.answer == "True" else "True"
    items = [(task, "1"), (task, "21"), (task, "1 2 3 4 5 6"), (ratio, f"{ratio.answer} {other}")]
    assert score_gym_answers(items) == [1.0, 0.0, 0.0, 0.0]


def test_a_verifier_result_counts_only_from_a_clean_execution():
    from tempering.envs.gym import verified_score

    ok = {"status": "ok", "flags": [], "calls": [{"i": 0, "ok": True, "value": "0.5"}]}
    assert verified_score(ok) == 0.5
    assert verified_score({**ok, "calls": [{"i": 0, "ok": True, "value": "7.0"}]}) == 1.0  # clipped
    assert verified_score({**ok, "calls": [{"i": 0, "ok": True, "value": "nan"}]}) == 0.0
    assert verified_score({**ok, "calls": [{"i": 0, "ok": True, "value": "[" * 100}]}) == 0.0
    assert verified_score({**ok, "calls": [{"i": 0, "ok": False, "error": "ValueError"}]}) == 0.0
    assert verified_score({**ok, "status": "timeout"}) == 0.0
    assert verified_score({**ok, "status": "sandbox_error", "calls": None}) == 0.0
    assert verified_score({**ok, "flags": ["exit_during_tests"]}) == 0.0
    assert verified_score({**ok, "flags": ["file_outside_scratch"]}) == 0.5  # reading its package's data


def test_workers_that_cannot_load_the_verifiers_are_refused_with_a_clear_error(monkeypatch):
    import tempering.envs.gym as gym
    from tempering.errors import SandboxError

    monkeypatch.setattr(gym, "import_paths", lambda: (str(gym.VERIFIER_DIR),))  # reasoning-gym not importable
    with pytest.raises(SandboxError, match="reasoning-gym verifiers must run in the sandbox.*reasoning_gym"):
        gym.verifier_pool("process", 3)


def test_the_verifier_pool_is_opened_by_the_sandbox_factory(monkeypatch):
    """The gym's pools are sandboxes like any other (`sandbox.open_sandbox`), with the verifiers' limits,
    import paths and preloaded module; one pool per (isolation, workers), opened once."""
    import tempering.envs.gym as gym

    opened = []
    monkeypatch.setattr(gym, "_pools", {})
    monkeypatch.setattr(gym, "open_sandbox", lambda s, **kw: opened.append((s, kw)) or object())
    first = gym.verifier_pool("process", 3)
    assert gym.verifier_pool("process", 3) is first and len(opened) == 1
    [(section, kw)] = opened
    assert (section.workers, section.isolation, section.url) == (3, "process", None)
    assert gym.limits_of(section) == gym.VERIFIER_LIMITS and section.memory_mb == 1024
    assert kw["preload"] == (gym.VERIFIER_MODULE,) and str(gym.VERIFIER_DIR) in kw["python_path"]


def test_generation_writes_nothing_into_the_working_directory(tmp_path, monkeypatch):
    """Some generators write scratch files where they run (temp_parameters.txt): not into the user's
    directory. A dataset that writes one at every entry stands in for them."""
    import reasoning_gym

    real = reasoning_gym.create_dataset

    def scribbling(name, **kw):
        ds = real(name, **kw)

        class Scribbling:
            def __getitem__(self, i):
                Path("temp_parameters.txt").write_text("scratch")
                return ds[i]

        return Scribbling()

    monkeypatch.setattr(reasoning_gym, "create_dataset", scribbling)
    monkeypatch.chdir(tmp_path)
    train, heldout = gym_tasks(["basic_arithmetic"], 3, 1, seed=0)
    assert len(train) == 3 and len(heldout) == 1
    assert list(tmp_path.iterdir()) == [] and Path.cwd() == tmp_path
