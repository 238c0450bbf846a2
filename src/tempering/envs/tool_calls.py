"""What the policy's text does in a tool episode: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes/Qwen convention) calls a tool, `<answer>...</answer>` ends the episode, and whichever tag comes
first decides, so a turn makes at most one call. Anything else is `Malformed`, with the error the model sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Answer:
    text: str
    """The text between the answer tags, stripped."""


@dataclass(frozen=True)
class Malformed:
    error: str
    """What is wrong, as shown to the model (starts with `error:`)."""


_OPEN_CALL, _CLOSE_CALL = "<tool_call>", "</tool_call>"
_OPEN_ANSWER, _CLOSE_ANSWER = "<answer>", "</answer>"
_CALL_SHAPE = "a tool call must be a JSON object with a string 'name' and an object 'arguments'"


def parse_action(action: str) -> ToolCall | Answer | Malformed:
    """Read one turn: the first of `<tool_call>` / `<answer>` decides what it does."""
    found = [(i, tag) for tag in (_OPEN_CALL, _OPEN_ANSWER) if (i := action.find(tag)) >= 0]
    if not found:
        return Malformed(f"error: no {_OPEN_CALL} or {_OPEN_ANSWER} tag found")
    start, tag = min(found)
    close = _CLOSE_CALL if tag == _OPEN_CALL else _CLOSE_ANSWER
    end = action.find(close, start + len(tag))
    if end < 0:
        return Malformed(f"error: {tag} is not closed with {close}")
    body = action[start + len(tag) : end].strip()
    if tag == _OPEN_ANSWER:
        return Answer(body)
    try:
        call = json.loads(body)
    except ValueError as exc:
        return Malformed(f"error: tool call is not valid JSON: {getattr(exc, 'msg', exc)}")
    except RecursionError:
        return Malformed("error: tool call is not valid JSON: nested too deeply")
    if not (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments"), dict)
    ):
        return Malformed(f"error: {_CALL_SHAPE}")
    return ToolCall(call["name"], call["arguments"])


def format_call(name: str, **arguments: Any) -> str:
    """The action that calls `name`: what a correct agent writes (used for reference episodes)."""
    return f"{_OPEN_CALL}{json.dumps({'name': name, 'arguments': arguments})}{_CLOSE_CALL}"


def format_answer(answer: Any) -> str:
    return f"{_OPEN_ANSWER}{answer}{_CLOSE_ANSWER}"


class ToolError(Exception):
    """The call was wrong (bad expression, missing key); its message is shown to the model."""
