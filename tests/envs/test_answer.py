"""Answer matching and Countdown checking."""

from tempering.envs import EnvContext, make_env
from tempering.envs.answer import check_countdown, extract_answer, generate_answer_tasks


def test_extract_answer_prefers_the_tag_then_the_last_answer_line():
    assert extract_answer("think...<answer> 42 </answer>") == "42"
    assert extract_answer("Answer: 3\nAnswer: 7") == "7"
    assert extract_answer("\n  1 2\n3 4\n") == "1 2\n3 4"  # a grid spans lines


def test_countdown_checks_numbers_and_target():
    assert check_countdown("3*5+7", [3, 5, 7], 22) == (True, "")
    ok, why = check_countdown("5*5-3", [3, 5, 7], 22)
    assert not ok and "not given" in why
    ok, why = check_countdown("3+5+7", [3, 5, 7], 22)
    assert not ok and "= 15, not 22" in why
    assert not check_countdown("__import__('os')", [1], 1)[0]


def test_answer_env_gives_feedback_and_a_second_try():
    train, heldout = generate_answer_tasks(20, 10, seed=1)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    task = next(t for t in train if t.domain == "arithmetic")
    env = make_env(task, EnvContext(max_turns=2))
    assert env.reset(task) == task.prompt
    wrong = env.step(str(task.answer + 1))
    assert not wrong.done and "incorrect" in wrong.observation and wrong.rewards == {"correct": 0.0}
    right = env.step(f"{task.answer}")
    assert right.done and right.info["success"] and right.rewards == {"correct": 1.0}


def test_every_reference_solves_its_task():
    train, _ = generate_answer_tasks(60, 0, seed=2)
    for task in train:
        env = make_env(task, EnvContext(max_turns=1))
        env.reset(task)
        assert env.step(task.reference_solution).info["success"], task
