"""The simulated services behind the tools, and `ToolBox`, which validates a call against its tool's JSON
schema and runs it. Each service's state (the database, the flaky API's failure streak) lives in one
episode's ToolBox: two episodes of one task share nothing. Services are deterministic given the env seed.

`calculator`, a key-value database (`db_get`, `db_set`, `db_keys`), `search` over the task's documents, and
a flaky `weather` API that fails on purpose (`flaky_failure_rate`, at most `flaky_max_failures` in a row) so
that retrying after an error is rewarded. A flaky failure is the service's fault, so it is not a `tool_error`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from tempering.envs.base import EnvContext
from tempering.envs.calculator import calculate, format_number
from tempering.envs.tool_calls import ToolCall, ToolError
from tempering.types import Task


class ServiceUnavailable(Exception):
    """A transient failure of the service, not of the call: the model should retry."""


def _schema(name: str, description: str, **properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
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
    tools = (
        _schema("db_get", "read a key from the db", key=_STRING),
        _schema("db_set", "set a key to an integer", key=_STRING, value=_INTEGER),
        _schema("db_keys", "list the db keys"),
    )

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
        hits = [d for score, _, d in sorted(scored, key=lambda s: s[:2], reverse=True)[: self.top_k] if score]
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
