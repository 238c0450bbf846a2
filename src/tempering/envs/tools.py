"""Tool calling with simulated services: the policy calls tools in text and answers when it knows.

Each action is parsed (`tool_calls.py`): a call goes to this episode's services (`services.py`: calculator,
database, search, a flaky weather API), whose result comes back as the observation
`<tool_response>RESULT</tool_response>\\n`; an answer ends the episode. Everything the model can get wrong -
no tag, an unclosed tag, bad JSON, an unknown tool, arguments that fail the tool's JSON schema, a call the
service rejects - comes back as `error: ...` text in that observation and costs a `tool_error` process
reward; `step` never raises on model text.
"""

from __future__ import annotations

from typing import Any

from tempering.envs.answer import answers_match
from tempering.envs.base import EnvContext, Environment, Step, clip_middle, register
from tempering.envs.services import TOOLS, CallResult, ToolBox
from tempering.envs.tool_calls import Answer, ToolCall, parse_action
from tempering.types import Task


def tool_declarations(task: Task) -> list[dict[str, Any]]:
    """The task's tools as chat templates take them: [{"type": "function", "function": JSON schema}]."""
    return [{"type": "function", "function": TOOLS[name]} for name in task.metadata.get("tools", [])]


@register
class ToolEnv(Environment):
    """One tool-use episode: calls until an answer, or until `ctx.max_turns` actions have been taken."""

    kind = "tool"
    components = frozenset({"success", "tool_error"})
    outcome = frozenset({"success"})
    default_weights = {"success": 1.0, "tool_error": -0.1}

    def __init__(self, ctx: EnvContext, seed: int = 0):
        super().__init__(ctx, seed)
        self.task: Task | None = None
        self.tools: ToolBox | None = None
        self.turns = 0
        self.done = False

    def reset(self, task: Task) -> str:
        self.task, self.turns, self.done = task, 0, False
        self.tools = ToolBox(task.metadata.get("tools", []), task, self.ctx, self.seed)
        return task.prompt

    def step(self, action: str) -> Step:
        # Misuse by the driver is a bug to surface; only model text is never allowed to raise.
        if self.task is None or self.tools is None or self.done:
            raise RuntimeError("ToolEnv.step called before reset() or after the episode ended")
        self.turns += 1
        parsed = parse_action(action)
        if isinstance(parsed, Answer):
            self.done = True
            success = self._solved(parsed.text)
            info = {"tool": None, "error": None, "unavailable": False}
            return Step(None, {"success": float(success), "tool_error": 0.0}, True, info, success=success)
        if isinstance(parsed, ToolCall):
            result = self.tools.call(parsed)
        else:
            result = CallResult(parsed.error, None, "tool_error")
        rewards = {"success": 0.0, "tool_error": float(result.status == "tool_error")}
        error = result.text if result.status != "ok" else None
        info = {"tool": result.tool, "error": error, "unavailable": result.status == "unavailable"}
        if self.turns >= self.ctx.max_turns:  # out of turns without an answer
            self.done = True
            return Step(None, rewards, True, info)
        return Step(
            f"<tool_response>{clip_middle(result.text, self.ctx.feedback_chars)}</tool_response>\n",
            rewards,
            False,
            info,
        )

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        assert self.task is not None, "reset first"
        return tool_declarations(self.task)

    def _solved(self, answer: str) -> bool:
        assert self.task is not None and self.tools is not None
        if not answers_match(answer, self.task.answer):
            return False
        expected = self.task.metadata.get("expected_db")
        return expected is None or self.tools.db_state(self.task.metadata.get("db", {})) == expected


def reference_episode(task: Task, ctx: EnvContext, seed: int = 0) -> list[tuple[str, str | None]]:
    """Play `task.metadata["reference"]` in a ToolEnv, retrying each call the flaky service fails.

    Returns (action, observation) pairs, observation None on the final step: a transcript for supervised
    warm-up that shows retries after errors. With failures it needs more turns than the reference has
    actions (up to `flaky_max_failures` more per flaky call); when `ctx.max_turns` runs out it stops there.
    """
    env = ToolEnv(ctx, seed)
    env.reset(task)
    transcript: list[tuple[str, str | None]] = []
    for action in task.metadata.get("reference", []):
        while True:
            step = env.step(action)
            transcript.append((action, step.observation))
            if step.done:
                return transcript
            if not step.info["unavailable"]:
                break
    return transcript
