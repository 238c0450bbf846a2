"""The tool environment and its parts: call parsing (`tool_calls`), the calculator, the simulated services,
rewards, the task generator."""

from __future__ import annotations

import pytest

from tempering.envs.base import ENVIRONMENTS, EnvContext, make_env
from tempering.envs.calculator import calculate
from tempering.envs.services import FLAKY_ERRORS, TOOLS
from tempering.envs.tool_calls import format_call, parse_action
from tempering.envs.tool_tasks import DOMAINS, generate_tool_tasks
from tempering.envs.tools import ToolEnv, reference_episode
from tempering.types import Task


def _task(tools: list[str], answer: object = "x", **metadata: object) -> Task:
    return Task(
        id="t",
        domain="test",
        prompt="Task: test\n",
        env="tool",
        answer=answer,
        metadata={"tools": tools, **metadata},
    )


def _env(task: Task, seed: int = 0, max_turns: int = 8, **options: object) -> ToolEnv:
    env = ToolEnv(EnvContext(max_turns=max_turns, options=dict(options)), seed)
    assert env.reset(task) == task.prompt
    return env


CALC = _task(["calculator"], answer=12)
DB = {"mox": 7, "zef": 41}


def test_registered_and_made_by_make_env():
    assert ENVIRONMENTS["tool"] is ToolEnv
    assert isinstance(make_env(CALC, EnvContext()), ToolEnv)
    assert TOOLS["calculator"]["parameters"]["required"] == ["expression"]


def test_tool_call_then_answer():
    env = _env(CALC)
    step = env.step(format_call("calculator", expression="3*4"))
    assert step.observation == "<tool_response>12</tool_response>\n"
    assert step.rewards == {"success": 0.0, "tool_error": 0.0} and not step.done
    assert step.info["tool"] == "calculator" and step.info["error"] is None
    final = env.step("The result: <answer>12.0</answer>")
    assert final.done and final.observation is None
    assert final.rewards == {"success": 1.0, "tool_error": 0.0} and final.success is True


def test_wrong_answer_fails():
    final = _env(CALC).step("<answer>13</answer>")
    assert final.done and final.rewards["success"] == 0.0 and final.success is False


def test_first_tag_decides():
    assert parse_action("<answer>4</answer> <tool_call>{}</tool_call>").text == "4"
    call = parse_action(f"{format_call('calculator', expression='1+1')} <answer>4</answer>")
    assert call.name == "calculator" and call.arguments == {"expression": "1+1"}


@pytest.mark.parametrize(
    "action, problem",
    [
        ("12", "no <tool_call> or <answer> tag"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "not closed"),
        ("<answer>12", "not closed"),
        ('<tool_call>{"name": "calculator", "arguments": </tool_call>', "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', "JSON object with a string 'name'"),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "JSON object with a string 'name'"),
        ('<tool_call>{"name": "calculator", "arguments": "3*4"}</tool_call>', "an object 'arguments'"),
        (
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            "unknown tool 'rm_rf'; available: calculator",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
            "arguments do not match calculator's schema: 'expression' is a required property",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": 3}}</tool_call>',
            "is not of type 'string'",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1", "x": 1}}</tool_call>',
            "Additional properties",
        ),
        (format_call("calculator", expression="1/0"), "division by zero"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "tool call"),
    ],
)
def test_malformed_call_is_an_error_observation(action, problem):
    step = _env(CALC).step(action)
    assert not step.done and step.rewards == {"success": 0.0, "tool_error": 1.0}
    assert step.observation.startswith("<tool_response>error: ") and problem in step.observation
    assert step.info["error"].startswith("error: ") and step.success is False


def test_service_exception_becomes_error_text(monkeypatch):
    def broken(self, expression):
        raise KeyError("boom")

    monkeypatch.setattr("tempering.envs.services.Calculator.calculator", broken)
    step = _env(CALC).step(format_call("calculator", expression="1"))
    assert step.rewards["tool_error"] == 1.0
    assert "error: calculator failed: KeyError" in step.observation


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "(1).__class__",
        "abs(-3)",
        "x + 1",
        "9**9**9",
        "2**1000",
        "10**20",
        "1e308 * 10",
        "(-8) ** 0.5",
        "[1, 2]",
        "1 if 1 else 2",
        "1" * 300,
    ],
)
def test_calculator_refuses_anything_but_small_arithmetic(expression):
    step = _env(CALC).step(format_call("calculator", expression=expression))
    assert step.info["error"] is not None and step.rewards["tool_error"] == 1.0


def test_calculator_arithmetic():
    for expression in [
        "37 * 4 + 5",
        "-(2 + 3) ** 2 // 4 % 5",
        "7 / 2",
        "2 ** -2 - 0.5",
        "+3 - -4 * (1.5 + 2)",
    ]:
        assert calculate(expression) == eval(expression)  # the slow reference: Python itself
    env = _env(CALC)
    assert (
        env.step(format_call("calculator", expression="12 / 4")).observation
        == "<tool_response>3</tool_response>\n"
    )
    assert (
        env.step(format_call("calculator", expression="1 / 3")).observation
        == "<tool_response>0.333333</tool_response>\n"
    )


def test_db_tools_and_missing_key():
    env = _env(_task(["db_get", "db_set", "db_keys"], db=DB))
    assert env.step(format_call("db_get", key="zef")).observation == "<tool_response>41</tool_response>\n"
    missing = env.step(format_call("db_get", key="nop"))
    assert "error: no key 'nop'" in missing.observation and missing.rewards["tool_error"] == 1.0
    assert env.step(format_call("db_set", key="nop", value=3)).info["error"] is None
    assert env.step(format_call("db_keys")).observation == "<tool_response>mox, nop, zef</tool_response>\n"
    bad = env.step(format_call("db_set", key="nop", value="three"))
    assert "db_set's schema" in bad.observation


def test_db_state_is_per_episode():
    task = _task(["db_get", "db_set"], db=DB)
    first, second = _env(task), _env(task)
    first.step(format_call("db_set", key="mox", value=99))
    assert first.step(format_call("db_get", key="mox")).observation == "<tool_response>99</tool_response>\n"
    assert second.step(format_call("db_get", key="mox")).observation == "<tool_response>7</tool_response>\n"
    assert task.metadata["db"]["mox"] == 7


def test_db_set_task_needs_the_right_final_state():
    task = _task(["db_set"], answer="done", db=DB, expected_db={**DB, "mox": 50})
    lazy = _env(task)
    assert lazy.step("<answer>done</answer>").rewards["success"] == 0.0
    wrong = _env(task)
    wrong.step(format_call("db_set", key="mox", value=51))
    assert wrong.step("<answer>done</answer>").rewards["success"] == 0.0
    right = _env(task)
    right.step(format_call("db_set", key="mox", value=50))
    assert right.step("<answer>Done</answer>").rewards["success"] == 1.0


def test_search_finds_the_right_doc():
    docs = [
        {"title": "Plim", "text": "The capital of Plim is Kab."},
        {"title": "Zorvia", "text": "The capital of Zorvia is Tesk. Zorvia has 12 moons."},
        {"title": "Vell", "text": "Vell has 3 moons."},
    ]
    env = _env(_task(["search"], docs=docs))
    out = env.step(format_call("search", query="capital of Zorvia")).observation
    assert out.startswith("<tool_response>Zorvia: The capital of Zorvia is Tesk.")
    assert "Vell" not in out  # no word in common
    assert "no results" in env.step(format_call("search", query="qwerty")).observation


def _weather_pattern(seed: int, calls: int = 12, **options: object) -> list[str]:
    env = _env(_task(["weather"], weather={"Brell": 21}), seed=seed, max_turns=calls + 1, **options)
    return [env.step(format_call("weather", city="Brell")).observation for _ in range(calls)]


def test_flaky_api_fails_then_succeeds():
    env = _env(_task(["weather"], weather={"Brell": 21}), flaky_failure_rate=1.0, flaky_max_failures=2)
    steps = [env.step(format_call("weather", city="Brell")) for _ in range(3)]
    assert [s.observation for s in steps] == [
        f"<tool_response>error: {e}</tool_response>\n" for e in FLAKY_ERRORS
    ] + ["<tool_response>21</tool_response>\n"]
    assert all(s.rewards["tool_error"] == 0.0 and not s.done for s in steps)  # the service's fault
    assert [s.info["unavailable"] for s in steps] == [True, True, False]


def test_flaky_api_never_fails_more_than_max_in_a_row():
    pattern = _weather_pattern(0, calls=40, flaky_failure_rate=0.9, flaky_max_failures=2)
    ok = [i for i, o in enumerate(pattern) if "21" in o]
    assert ok and all(b - a <= 3 for a, b in zip([-1] + ok, ok))
    assert _weather_pattern(0, flaky_failure_rate=0.0) == ["<tool_response>21</tool_response>\n"] * 12


def test_flaky_api_is_deterministic_in_seed():
    assert _weather_pattern(3) == _weather_pattern(3)
    assert len({tuple(_weather_pattern(seed)) for seed in range(4)}) > 1


def test_episode_ends_at_max_turns():
    env = _env(CALC, max_turns=2)
    assert not env.step(format_call("calculator", expression="3*4")).done
    last = env.step(format_call("calculator", expression="3*4"))
    assert last.done and last.observation is None
    assert last.rewards["success"] == 0.0 and last.success is False
    with pytest.raises(RuntimeError):
        env.step("<answer>12</answer>")


@pytest.mark.parametrize("rate", [0.0, 0.7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_episode_solves_every_generated_task(seed, rate):
    train, heldout = generate_tool_tasks(25, 10, seed=seed)
    ctx = EnvContext(max_turns=8, options={"flaky_failure_rate": rate})
    retries = 0
    for i, task in enumerate(train + heldout):
        transcript = reference_episode(task, ctx, seed=i)
        assert transcript[-1] == (task.metadata["reference"][-1], None), task.id
        env = _env(task, seed=i, max_turns=8, flaky_failure_rate=rate)
        steps = [env.step(action) for action, _ in transcript]
        assert steps[-1].done and steps[-1].success, task.id
        retries += len(transcript) - len(task.metadata["reference"])
    assert (retries > 0) == (rate > 0)


def test_generator_is_deterministic_with_disjoint_heldout():
    train, heldout = generate_tool_tasks(60, 20, seed=5)
    again = generate_tool_tasks(60, 20, seed=5)
    assert [t.model_dump() for t in train + heldout] == [t.model_dump() for t in again[0] + again[1]]
    assert [t.prompt for t in train] != [t.prompt for t in generate_tool_tasks(60, 20, seed=6)[0]]
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    assert len({t.prompt for t in train}) == len(train)
    assert {t.domain for t in train} == set(DOMAINS) and {t.domain for t in heldout} == set(DOMAINS)
    for task in train + heldout:
        assert task.env == "tool" and task.prompt.endswith("\n") and len(task.prompt) < 250
        assert task.prompt.count("\ntool ") + task.prompt.startswith("tool ") == len(task.metadata["tools"])
        assert all(f"tool {name}(" in task.prompt for name in task.metadata["tools"])
