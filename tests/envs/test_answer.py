"""Answer matching and Countdown checking."""

from tempering.envs import EnvContext, make_env
from tempering.envs.answer import COUNTDOWN_RULES, check_countdown, extract_answer, generate_answer_tasks


def test_extract_answer_prefers_the_tag_then_the_last_answer_line():
    assert extract_answer("think...<answer> 42 </answer>") == "42"
    assert extract_answer("Answer: 3\nAnswer: 7") == "7"
    assert extract_answer("\n  1 2\n3 4\n") == "1 2\n3 4"  # a grid spans lines


def test_extract_answer_reads_a_stated_answer_when_nothing_marks_one():
    assert extract_answer("120 = 8 * 15, so the answer is 12. The final answer is 8.") == "8"
    assert extract_answer("The answer is: 2") == "2"
    assert extract_answer("The answer is 7.\nAnswer: 9") == "9"  # a marked answer wins
    assert extract_answer("<answer>3</answer> The answer is 4.") == "3"
    assert extract_answer("an answer isn't given") == "an answer isn't given"


def test_countdown_checks_numbers_and_target():
    assert check_countdown("3*5+7", [3, 5, 7], 22) == (True, "")
    ok, why = check_countdown("5*5-3", [3, 5, 7], 22)
    assert not ok and "not given" in why
    ok, why = check_countdown("3+5+7", [3, 5, 7], 22)
    assert not ok and "= 15, not 22" in why
    assert not check_countdown("__import__('os')", [1], 1)[0]


def test_countdown_accepts_exactly_what_its_prompt_asks_for():
    [task], _ = generate_answer_tasks(1, 0, seed=0, domains=["countdown"])
    assert (
        COUNTDOWN_RULES in task.prompt.lower()
    )  # "use each number exactly once, with + - * and parentheses"
    numbers = [2, 2, 4]
    assert check_countdown("2*2*4", numbers, 16) == (True, "")
    assert check_countdown("  ( 2 * (2) ) *4 ", numbers, 16) == (True, "")  # whitespace and parentheses
    assert check_countdown("4*(2+2)", numbers, 16) == (True, "")
    cases = {
        "2*4": "does not use every number: [2] left",  # a number missing
        "2*2*4*2": "more often than given",  # a number reused
        "4*4": "more often than given",  # a number used more often than given
        "2/2*4*2": "only the given numbers, + - *",  # division
        "16": "not given",  # a bare number (the target itself)
        "-2*-2*4": "only the given numbers, + - *",  # unary minus makes a number not given
        "2**2*4": "only the given numbers, + - *",  # power
        "2.0*2*4": "only the given numbers, + - *",  # a float
        "1+" * 150 + "1": "longer than 200 characters",  # refused before parsing
        "2*2*": "not an arithmetic expression",
    }
    for expression, why in cases.items():
        ok, message = check_countdown(expression, numbers, 16)
        assert not ok and why in message, (expression, message)
    assert check_countdown("2*2+4", numbers, 16) == (False, "2*2+4 = 8, not 16")


def test_countdown_never_crashes_on_deep_or_huge_input():
    for text in ["(" * 100 + "1" + ")" * 100, "-" * 199 + "1", "1" * 199, "[" * 199, "1+" * 3000 + "1"]:
        assert not check_countdown(text, [1], 1)[0]


def test_answer_env_gives_feedback_and_a_second_try():
    train, heldout = generate_answer_tasks(20, 10, seed=1)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    task = next(t for t in train if t.domain == "arithmetic")
    env = make_env(task, EnvContext(max_turns=2))
    assert env.reset(task) == task.prompt
    wrong = env.step(str(task.answer + 1))
    assert not wrong.done and "incorrect" in wrong.observation and wrong.rewards == {"correct": 0.0}
    right = env.step(f"{task.answer}")
    assert right.done and right.success and right.rewards == {"correct": 1.0}


def test_every_reference_solves_its_task():
    train, _ = generate_answer_tasks(60, 0, seed=2)
    for task in train:
        env = make_env(task, EnvContext(max_turns=1))
        env.reset(task)
        assert env.step(task.reference_solution).success, task
