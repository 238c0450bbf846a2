"""The repair agent: the episode driver with a stop rule - feedback into the next turn, stuck detection,
the attempt log, and its token-level agreement with multi-turn RL episodes (a model trained on episodes is
the agent's model as it is)."""

import json

from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.agent.repair import ATTEMPT_FIELDS, RepairSettings, repair
from tempering.envs import EnvContext
from tempering.envs.code import program_of
from tempering.inference.chat import chat_format
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.rollout.episodes import run_episodes
from tempering.types import Task, TestCase
from tests.helpers.repair import Scripted

TASK = Task(
    id="inc",
    domain="d",
    prompt="def inc(x):\n",
    entry_point="inc",
    tests=[TestCase(input=[1], output=2), TestCase(input=[5], output=6)],
    examples=[TestCase(input=[3], output=4)],
)
RIGHT = "def inc(x):\n    return x + 1\n"


def tasks(*names):
    return [TASK.model_copy(update={"id": n, "prompt": f"def {n}(x):\n", "entry_point": n}) for n in names]


def program(name, body):
    return f"def {name}(x):\n    return {body}\n"


def test_feedback_goes_into_the_next_turn_and_a_fix_solves_it(sandbox, tmp_path, tiny):
    engine = Scripted(tiny[1], {"a": [program("a", "x - 1"), program("a", "x + 1")]})
    log = tmp_path / "attempts.jsonl"
    report = repair(engine, tasks("a"), EnvContext(sandbox), log=JsonLog(log))
    assert report.summary()["first_turn_pass@1"] == 0.0 and report.summary()["pass@1"] == 1.0
    second = tiny[1].decode(
        engine.seen[1][0]
    )  # the second turn's context: prompt, first attempt, the feedback
    assert "# feedback: f(3) returned 2, expected 4" in second  # the env's own feedback
    assert second.index(program("a", "x - 1")) < second.index("# feedback:")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["class"] for r in records] == ["wrong_answer", "passed"]
    assert all(set(r) == set(ATTEMPT_FIELDS) for r in records)
    assert records[0]["feedback"] in second and records[1]["ended"] == "solved"
    assert records[0]["visible_failures"] == ["f(3) returned 2, expected 4"]
    assert records[1]["prompt_tokens"] > records[0]["prompt_tokens"] > 0


def test_the_same_error_twice_is_stuck(sandbox, tiny):
    same = program("s", "x - 1")
    different = [program("d", "x - 1"), program("d", "1 // 0"), program("d", "x + 7"), program("d", "x * 3")]
    engine = Scripted(tiny[1], {"s": [same, program("s", "x - 1 ")] * 2, "d": different})
    report = repair(engine, tasks("s", "d"), EnvContext(sandbox), RepairSettings(repairs=3))
    s, d = report.episodes
    assert s.ended == "stuck" and s.classes == ["wrong_answer", "wrong_answer"]  # stopped after the repeat
    assert d.ended == "repairs" and d.classes == [
        "wrong_answer",
        "runtime_error",
        "wrong_answer",
        "wrong_answer",
    ]
    assert report.summary()["stuck_rate"] == 0.5
    unstuck = repair(
        Scripted(tiny[1], {"s": [same] * 4}),
        tasks("s"),
        EnvContext(sandbox),
        RepairSettings(repairs=3, stop_when_stuck=False),
    )
    assert unstuck.episodes[0].ended == "repairs" and len(unstuck.episodes[0].classes) == 4


def test_metrics_and_alert_follow_the_episodes(sandbox, tiny):
    metrics, alerts = Metrics(), []
    rule = AlertRule(alerts.append, threshold=0.5, window=4, min_events=2, metrics=metrics)
    names = [f"t{i}" for i in range(4)]
    engine = Scripted(tiny[1], {n: [program(n, "x")] * 4 for n in names})  # never right
    repair(engine, tasks(*names), EnvContext(sandbox), RepairSettings(repairs=3), metrics=metrics, alert=rule)
    assert len(alerts) == 1 and alerts[0]["failure_rate"] == 1.0
    text = metrics.render().decode()
    assert 'tempering_attempts_total{outcome="wrong_answer"} 8.0' in text  # each stuck after its repeat
    assert 'tempering_episodes_total{result="stuck"} 4.0' in text


def test_the_agent_is_the_multi_turn_episode_of_training(tiny, tasks, sandbox):
    """With a local engine the agent's episodes are token for token the multi-turn RL episodes (one driver):
    the same actions, and the plain format renders the conversation to exactly the episode's ids."""
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(1.0, 1.0, 24))
    ctx = EnvContext(sandbox, max_turns=2, feedback_chars=200)
    [episode] = run_episodes(engine, tasks[1][:1], ctx, group_size=1, max_context=180, greedy=True)
    assert len(episode.turns) == 2, "the random model fails its first attempt"
    first = episode.turns[0]
    messages = [
        {"role": "user", "content": episode.task.prompt},
        {"role": "assistant", "content": first.action},
        {"role": "user", "content": first.observation},
    ]
    second_start = (
        episode.turn_ends[0] + 1 + (len(episode.ids) - episode.turn_ends[0] - 1 - episode.turns[1].tokens)
    )
    assert chat_format(tokenizer).render(messages) == episode.prompt_ids + episode.ids[:second_start]
    log = []
    repair(
        engine,
        tasks[1][:1],
        ctx,
        RepairSettings(repairs=1, stop_when_stuck=False),
        max_context=180,
        log=type("Log", (), {"write": lambda self, r: log.append(r)})(),
    )
    assert [r["program"] for r in log] == [program_of(episode.task, t.action) for t in episode.turns]
    # The second turn computed only what is new: the first action's last token and the feedback.
    new = len(episode.ids) - episode.turns[1].tokens - episode.turns[0].tokens + 1
    assert (
        episode.turns[1].computed
        == new
        < len(episode.prompt_ids) + len(episode.ids) - episode.turns[1].tokens
    )
