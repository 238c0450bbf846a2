"""Tool calling with simulated services: the policy calls tools in text and answers when it knows.

An action is model text. `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes/Qwen
convention) calls a tool; `<answer>...</answer>` ends the episode. Whichever tag comes first is what the
action does, so a turn makes at most one call. The tool's result comes back as the observation
`<tool_response>RESULT</tool_response>\\n`. Everything the model can get wrong - no tag, an unclosed tag,
bad JSON, an unknown tool, arguments that fail the tool's JSON schema, a call the service rejects - comes
back as `error: ...` text in that observation and costs a `tool_error` process reward; `step` never raises
on model text. The services are deterministic given the env seed, and their state (the database, the flaky
API's failure streak) lives in the episode: two episodes of one task share nothing.

Services: `calculator` (arithmetic through `ast`, never `eval`), a key-value database (`db_get`,
`db_set`, `db_keys`), `search` over the task's documents, and a flaky `weather` API that fails on purpose
(`flaky_failure_rate`, at most `flaky_max_failures` in a row) so that retrying after an error is rewarded.
A flaky failure is the service's fault, so it is not a `tool_error`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from tempering.envs.answer import answers_match
from tempering.envs.base import EnvContext, Environment, Step, clip_middle, register
from tempering.types import Task

# ----------------------------------------------------------------------------------------------- parsing


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
    body = action[start + len(tag):end].strip()
    if tag == _OPEN_ANSWER:
        return Answer(body)
    try:
        call = json.loads(body)
    except ValueError as exc:
        return Malformed(f"error: tool call is not valid JSON: {getattr(exc, 'msg', exc)}")
    except RecursionError:
        return Malformed("error: tool call is not valid JSON: nested too deeply")
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments"), dict)):
        return Malformed(f"error: {_CALL_SHAPE}")
    return ToolCall(call["name"], call["arguments"])


def format_call(name: str, **arguments: Any) -> str:
    """The action that calls `name`: what a correct agent writes (used for reference episodes)."""
    return f"{_OPEN_CALL}{json.dumps({'name': name, 'arguments': arguments})}{_CLOSE_CALL}"


def format_answer(answer: Any) -> str:
    return f"{_OPEN_ANSWER}{answer}{_CLOSE_ANSWER}"


# -------------------------------------------------------------------------------------------- calculator


class ToolError(Exception):
    """The call was wrong (bad expression, missing key); its message is shown to the model."""


class ServiceUnavailable(Exception):
    """A transient failure of the service, not of the call: the model should retry."""


MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e15
_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


def calculate(expression: str) -> int | float:
    """Evaluate arithmetic on int/float literals; everything else (names, calls, attributes) is refused.

    Exponents and every intermediate result are capped, so `9**9**9` is refused instead of hanging.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f"cannot parse expression {expression!r}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (limit {MAX_EXPONENT})")
        try:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result is too large") from None
    raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def _checked(value: Any) -> int | float:
    # A negative base to a fractional power is complex in Python: not arithmetic this tool offers.
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"result is out of range (limit {MAX_MAGNITUDE:g})")
    return value


def format_number(value: int | float) -> str:
    """Integral results print as ints (12, not 12.0) so a small model can copy them into its answer."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else repr(round(value, 6))


# ---------------------------------------------------------------------------------- services and toolbox


def _schema(name: str, description: str, **properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties),
                  "additionalProperties": False}
    return {"name": name, "description": description, "parameters": parameters}


_STRING, _INTEGER = {"type": "string"}, {"type": "integer"}


class Service:
    """Per-episode state behind one or more tools; each tool is a method of the same name."""

    tools: ClassVar[tuple[dict[str, Any], ...]]
    """The JSON-schema declarations of this service's tools."""

    def __init__(self, task: Task, ctx: EnvContext, seed: int) -> None:
        self.task, self.ctx, self.seed = task, ctx, seed


class Calculator(Service):
    tools = (_schema("calculator", "evaluate arithmetic", expression=_STRING),)

    def calculator(self, expression: str) -> str:
        return format_number(calculate(expression))


class Database(Service):
    tools = (_schema("db_get", "read a key from the db", key=_STRING),
             _schema("db_set", "set a key to an integer", key=_STRING, value=_INTEGER),
             _schema("db_keys", "list the db keys"))

    def __init__(self, task: Task, ctx: EnvContext, seed: int) -> None:
        super().__init__(task, ctx, seed)
        # This episode's copy: writes never reach the task or another episode.
        self.data: dict[str, int] = {str(k): int(v) for k, v in task.metadata.get("db", {}).items()}

    def db_get(self, key: str) -> str:
        if key not in self.data:
            raise ToolError(f"no key '{key}'")
        return str(self.data[key])

    def db_set(self, key: str, value: int) -> str:
        self.data[key] = int(value)  # JSON schema's "integer" also admits 5.0
        return "ok"

    def db_keys(self) -> str:
        return ", ".join(sorted(self.data)) or "(empty)"


_STOPWORDS = frozenset("a an and the of is in on to what how many does do which who".split())


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower())) - _STOPWORDS


class Search(Service):
    tools = (_schema("search", "search the notes", query=_STRING),)
    top_k: ClassVar[int] = 2

    def search(self, query: str) -> str:
        """The best documents by word overlap with the query; ties keep document order (deterministic)."""
        docs = self.task.metadata.get("docs", [])
        wanted = _words(query)
        scored = [(len(wanted & _words(f"{d['title']} {d['text']}")), -i, d) for i, d in enumerate(docs)]
        hits = [d for score, _, d in sorted(scored, key=lambda s: s[:2], reverse=True)[:self.top_k] if score]
        return "\n".join(f"{d['title']}: {d['text']}" for d in hits) or "no results"


FLAKY_ERRORS = ("503 service unavailable, try again", "timeout after 2.0 s, try again")


class Weather(Service):
    """A flaky API: each call fails with probability `flaky_failure_rate`, drawn from `seed:call_index`.

    At most `flaky_max_failures` calls fail in a row, so retrying always succeeds in the end.
    """

    tools = (_schema("weather", "temperature of a city", city=_STRING),)

    def __init__(self, task: Task, ctx: EnvContext, seed: int) -> None:
        super().__init__(task, ctx, seed)
        self.temperatures = {str(c).lower(): int(t) for c, t in task.metadata.get("weather", {}).items()}
        self.failure_rate = float(ctx.options.get("flaky_failure_rate", 0.5))
        self.max_failures = int(ctx.options.get("flaky_max_failures", 2))
        self.calls = 0  # calls so far: indexes the failure draws
        self.streak = 0  # failures in a row
        self.failures = 0  # failures so far: alternates the error text

    def weather(self, city: str) -> str:
        index, self.calls = self.calls, self.calls + 1
        draw = random.Random(f"{self.seed}:{index}").random()
        if self.streak < self.max_failures and draw < self.failure_rate:
            self.streak, self.failures = self.streak + 1, self.failures + 1
            raise ServiceUnavailable(FLAKY_ERRORS[(self.failures - 1) % len(FLAKY_ERRORS)])
        self.streak = 0
        if city.strip().lower() not in self.temperatures:
            raise ToolError(f"no weather data for '{city}'")
        return str(self.temperatures[city.strip().lower()])


_SERVICE_CLASSES = (Calculator, Database, Search, Weather)
SERVICES: dict[str, type[Service]] = {s["name"]: cls for cls in _SERVICE_CLASSES for s in cls.tools}
"""Tool name -> the service that answers it."""
TOOLS: dict[str, dict[str, Any]] = {s["name"]: s for cls in _SERVICE_CLASSES for s in cls.tools}
"""Tool name -> its JSON-schema declaration ({"name", "description", "parameters"})."""


def tool_line(name: str) -> str:
    """How a prompt lists a tool: `tool calculator(expression): evaluate arithmetic`."""
    schema = TOOLS[name]
    return f"tool {name}({', '.join(schema['parameters']['properties'])}): {schema['description']}"


@dataclass(frozen=True)
class CallResult:
    text: str
    """The tool's output, or the error shown to the model (`error: ...`)."""
    tool: str | None
    """The tool called, when the call named a known one."""
    status: Literal["ok", "tool_error", "unavailable"]
    """`tool_error`: the call was wrong or the tool raised; `unavailable`: a transient service failure."""


class ToolBox:
    """The tools of one episode: their schema validators and the services (with state) that answer them."""

    def __init__(self, names: Iterable[str], task: Task, ctx: EnvContext, seed: int) -> None:
        self.services: dict[type[Service], Service] = {}
        self.handlers: dict[str, Callable[..., str]] = {}
        self.validators: dict[str, Draft202012Validator] = {}
        for name in names:
            if name not in SERVICES:
                raise ValueError(f"task '{task.id}': unknown tool '{name}'; known: {', '.join(SERVICES)}")
            cls = SERVICES[name]
            if cls not in self.services:
                self.services[cls] = cls(task, ctx, seed)
            self.handlers[name] = getattr(self.services[cls], name)
            self.validators[name] = Draft202012Validator(TOOLS[name]["parameters"])

    def call(self, call: ToolCall) -> CallResult:
        """Validate and run one call; every failure becomes error text."""
        if call.name not in self.handlers:
            known = ", ".join(self.handlers) or "none"
            return CallResult(f"error: unknown tool '{call.name}'; available: {known}", None, "tool_error")
        problem = best_match(self.validators[call.name].iter_errors(call.arguments))
        if problem is not None:
            text = f"error: arguments do not match {call.name}'s schema: {problem.message}"
            return CallResult(text, call.name, "tool_error")
        try:
            return CallResult(self.handlers[call.name](**call.arguments), call.name, "ok")
        except ServiceUnavailable as exc:
            return CallResult(f"error: {exc}", call.name, "unavailable")
        except ToolError as exc:
            return CallResult(f"error: {exc}", call.name, "tool_error")
        except Exception as exc:  # a bug in a service must not end the rollout; the model sees it
            text = f"error: {call.name} failed: {type(exc).__name__}: {exc}"
            return CallResult(text, call.name, "tool_error")

    def db_state(self, initial: Mapping[str, int]) -> dict[str, int]:
        """The database at this point of the episode (its initial contents when no db tool was offered)."""
        db = self.services.get(Database)
        return dict(db.data) if isinstance(db, Database) else {str(k): int(v) for k, v in initial.items()}

# ------------------------------------------------------------------------------- judging and environment


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
            info = {"success": success, "tool": None, "error": None, "unavailable": False}
            return Step(None, {"success": float(success), "tool_error": 0.0}, True, info)
        if isinstance(parsed, ToolCall):
            result = self.tools.call(parsed)
        else:
            result = CallResult(parsed.error, None, "tool_error")
        rewards = {"success": 0.0, "tool_error": float(result.status == "tool_error")}
        error = result.text if result.status != "ok" else None
        info = {"success": False, "tool": result.tool, "error": error, "unavailable": result.status == "unavailable"}
        if self.turns >= self.ctx.max_turns:  # out of turns without an answer
            self.done = True
            return Step(None, rewards, True, info)
        return Step(f"<tool_response>{clip_middle(result.text, self.ctx.feedback_chars)}</tool_response>\n",
                    rewards, False, info)

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
            observation, _, done, info = env.step(action)
            transcript.append((action, observation))
            if done:
                return transcript
            if not info["unavailable"]:
                break
    return transcript
