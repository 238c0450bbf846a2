"""The repair agent: feedback into the next turn, stuck detection, the attempt log, and its token-level
agreement with multi-turn RL episodes (a model trained on episodes is the agent's model as it is)."""

import json

import torch

from tempering.agent.backends import Completion, LocalChat
from tempering.agent.monitor import AlertRule, JsonLog, Metrics
from tempering.agent.repair import ATTEMPT_FIELDS, RepairSettings, repair
from tempering.envs import EnvContext
from tempering.rollout.chat import chat_format
from tempering.rollout.engine import LocalEngine, SamplingParams
from tempering.rollout.episodes import run_episodes
from tempering.types import Task, TestCase

TASK = Task(id="inc", domain="d", prompt="def inc(x):\n", entry_point="inc",
            tests=[TestCase(input=[1], output=2), TestCase(input=[5], output=6)],
            examples=[TestCase(input=[3], output=4)])
RIGHT = "def inc(x):\n    return x + 1\n"


class Scripted:
    """A backend answering each task's turns from a script; records what it was shown."""

    name = "scripted"

    def __init__(self, script: dict[str, list[str]]):
        self.script, self.seen = script, []

    def chat(self, conversations, *, max_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.seen.append(conversations)
        out = []
        for messages in conversations:
            task_id = next(t for t in self.script if messages[0]["content"].endswith(f"def {t}(x):\n"))
            out.append(Completion(self.script[task_id][len(messages) // 2], "stop", 10, 5))
        return out


def tasks(*names):
    return [TASK.model_copy(update={"id": n, "prompt": f"def {n}(x):\n", "entry_point": n}) for n in names]


def program(name, body):
    return f"def {name}(x):\n    return {body}\n"


def test_feedback_goes_into_the_next_turn_and_a_fix_solves_it(sandbox, tmp_path):
    backend = Scripted({"a": [program("a", "x - 1"), program("a", "x + 1")]})
    log = tmp_path / "attempts.jsonl"
    report = repair(backend, tasks("a"), EnvContext(sandbox), log=JsonLog(log))
    assert report.summary()["pass@1_single_shot"] == 0.0 and report.summary()["pass@1_with_repairs"] == 1.0
    second = backend.seen[1][0]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[2]["content"].startswith("# feedback: f(3) returned 2, expected 4")  # the env's own feedback
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["class"] for r in records] == ["wrong_answer", "passed"]
    assert all(set(r) == set(ATTEMPT_FIELDS) for r in records)
    assert records[0]["feedback"] == second[2]["content"] and records[1]["ended"] == "solved"
    assert records[0]["visible_failures"] == ["f(3) returned 2, expected 4"]


def test_the_same_error_twice_is_stuck(sandbox):
    same = program("s", "x - 1")
    different = [program("d", "x - 1"), program("d", "1 // 0"), program("d", "x + 7"), program("d", "x * 3")]
    backend = Scripted({"s": [same, program("s", "x - 1 ")] * 2, "d": different})
    report = repair(backend, tasks("s", "d"), EnvContext(sandbox), RepairSettings(repairs=3))
    s, d = report.episodes
    assert s.ended == "stuck" and s.classes == ["wrong_answer", "wrong_answer"]  # stopped after the repeat
    assert d.ended == "repairs" and d.classes == ["wrong_answer", "runtime_error", "wrong_answer", "wrong_answer"]
    assert report.summary()["stuck_rate"] == 0.5
    unstuck = repair(Scripted({"s": [same] * 4}), tasks("s"), EnvContext(sandbox),
                     RepairSettings(repairs=3, stop_when_stuck=False))
    assert unstuck.episodes[0].ended == "repairs" and len(unstuck.episodes[0].classes) == 4


def test_metrics_and_alert_follow_the_episodes(sandbox):
    metrics, alerts = Metrics(), []
    rule = AlertRule(alerts.append, threshold=0.5, window=4, min_events=2, metrics=metrics)
    names = [f"t{i}" for i in range(4)]
    backend = Scripted({n: [program(n, "x")] * 4 for n in names})  # never right
    repair(backend, tasks(*names), EnvContext(sandbox), RepairSettings(repairs=3), metrics=metrics, alert=rule)
    assert len(alerts) == 1 and alerts[0]["failure_rate"] == 1.0
    text = metrics.render().decode()
    assert 'tempering_attempts_total{outcome="wrong_answer"} 8.0' in text  # each stuck after its repeat
    assert 'tempering_episodes_total{result="stuck"} 4.0' in text


def test_a_conversation_renders_to_the_episode_tokens(tiny, tasks, sandbox):
    """The plain format: what the agent (or the server) generates from after one failed attempt is the
    exact token sequence a 2-turn training episode holds at that point."""
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(1.0, 1.0, 24))
    ctx = EnvContext(sandbox, max_turns=2, feedback_chars=200)
    [episode] = run_episodes(engine, tasks[1][:1], ctx, group_size=1, max_context=180, greedy=True)
    assert len(episode.turns) == 2, "the random model fails its first attempt"
    first = episode.turns[0]
    messages = [{"role": "user", "content": episode.conversation.messages[0]["content"]},
                {"role": "assistant", "content": first.action}, {"role": "user", "content": first.observation}]
    second_start = episode.turn_ends[0] + 1 + (len(episode.ids) - episode.turn_ends[0] - 1 - episode.turns[1].tokens)
    assert chat_format(tokenizer).render(messages) == episode.prompt_ids + episode.ids[:second_start]
    chat = LocalChat(model, tokenizer)
    torch.manual_seed(0)
    [completion] = chat.chat([messages], max_tokens=24, temperature=0.0)
    assert completion.text == episode.turns[1].action  # greedy: the same second attempt
