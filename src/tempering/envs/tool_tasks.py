"""Built-in tool-use tasks: five domains over the simulated services of `tempering.envs.services`.

tool_calc (calculator), tool_db_get / tool_db_set (the key-value database; a set task is judged on the final
database), tool_search (facts about made-up entities, found only in the task's notes), tool_flaky (the
weather API that fails on purpose). Made-up words and small numbers keep the tasks within a tiny model's
reach; every task carries the actions of a correct agent (`metadata["reference"]`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tempering.envs.calculator import calculate
from tempering.envs.services import tool_line
from tempering.envs.tool_calls import format_answer, format_call
from tempering.types import Task

# --------------------------------------------------------------------------------------------- generator

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
DOMAINS = ("tool_calc", "tool_db_get", "tool_db_set", "tool_search", "tool_flaky")


def _word(rng: random.Random, syllables: int) -> str:
    """A short pronounceable made-up word (`mox`, `zorvi`): nothing a model could know without the tools."""
    word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
    return word + rng.choice(_CONSONANTS) if rng.random() < 0.5 else word


def _words_unique(rng: random.Random, n: int, syllables: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        if (w := _word(rng, syllables)) not in out:
            out.append(w)
    return out


@dataclass
class _Draft:
    """A generated task before it gets its id and rendered prompt."""

    tools: list[str]
    text: str
    """The `Task:` line's content."""
    answer: Any
    reference: list[str]
    """The actions of a correct agent when nothing fails."""
    services: dict[str, Any] = field(default_factory=dict)
    """db / docs / weather / expected_db, as the task's metadata carries them."""


def _calc(rng: random.Random) -> _Draft:
    x, y, z = rng.randint(10, 99), rng.randint(2, 9), rng.randint(1, 99)
    expression = rng.choice(
        ["{x} * {y} + {z}", "{z} + {x} * {y}", "({x} + {z}) * {y}", "{x} * {y} - {z}", "{x} + {z} - {y}"]
    ).format(x=x, y=y, z=z)
    answer = calculate(expression)
    return _Draft(
        ["calculator"],
        f"What is {expression}?",
        answer,
        [format_call("calculator", expression=expression), format_answer(answer)],
    )


def _db_get(rng: random.Random) -> _Draft:
    db = {k: rng.randint(0, 99) for k in _words_unique(rng, 3, 1)}
    key = rng.choice(sorted(db))
    return _Draft(
        ["db_get"],
        f"Get the value of {key} from the db.",
        db[key],
        [format_call("db_get", key=key), format_answer(db[key])],
        {"db": db},
    )


def _db_set(rng: random.Random) -> _Draft:
    db = {k: rng.randint(0, 99) for k in _words_unique(rng, 3, 1)}
    key = rng.choice(sorted(db) + _words_unique(rng, 1, 1))  # an existing key or (maybe) a new one
    value = rng.choice([v for v in range(100) if v != db.get(key)])  # doing nothing must not succeed
    expected = {**db, key: value}
    return _Draft(
        ["db_set"],
        f"Set {key} to {value} in the db, then answer done.",
        "done",
        [format_call("db_set", key=key, value=value), format_answer("done")],
        {"db": db, "expected_db": expected},
    )


def _search(rng: random.Random) -> _Draft:
    names = [w.capitalize() for w in _words_unique(rng, 6, 2)]
    entities, capitals = names[:3], names[3:]
    moons = [rng.randint(2, 99) for _ in entities]
    docs = [
        {"title": e, "text": f"The capital of {e} is {c}. {e} has {m} moons."}
        for e, c, m in zip(entities, capitals, moons)
    ]
    i = rng.randrange(3)
    if rng.random() < 0.5:
        text, answer = f"What is the capital of {entities[i]}?", capitals[i]
    else:
        text, answer = f"How many moons does {entities[i]} have?", moons[i]
    return _Draft(
        ["search"],
        text,
        answer,
        [format_call("search", query=entities[i]), format_answer(answer)],
        {"docs": docs},
    )


def _flaky(rng: random.Random) -> _Draft:
    weather = {c.capitalize(): rng.randint(0, 39) for c in _words_unique(rng, 3, 2)}
    city = rng.choice(sorted(weather))
    return _Draft(
        ["weather"],
        f"What is the temperature in {city}?",
        weather[city],
        [format_call("weather", city=city), format_answer(weather[city])],
        {"weather": weather},
    )


_BUILDERS: dict[str, Callable[[random.Random], _Draft]] = {
    "tool_calc": _calc,
    "tool_db_get": _db_get,
    "tool_db_set": _db_set,
    "tool_search": _search,
    "tool_flaky": _flaky,
}


def render_prompt(tools: Iterable[str], text: str) -> str:
    """One line per tool, then the task: short, for a tiny model trained from scratch."""
    return "".join(f"{tool_line(t)}\n" for t in tools) + f"Task: {text}\n"


def generate_tool_tasks(num_train: int, num_heldout: int, seed: int) -> tuple[list[Task], list[Task]]:
    """Tool-use tasks cycling through `DOMAINS`, deterministic in `seed`; no prompt appears twice, so no
    held-out prompt is ever trained on."""
    rng = random.Random(f"tool-tasks:{seed}")
    seen: set[str] = set()
    splits: tuple[list[Task], list[Task]] = ([], [])
    for split, count, tasks in (("train", num_train, splits[0]), ("heldout", num_heldout, splits[1])):
        for i in range(count):
            domain = DOMAINS[i % len(DOMAINS)]
            for _ in range(1000):
                draft = _BUILDERS[domain](rng)
                prompt = render_prompt(draft.tools, draft.text)
                if prompt not in seen:
                    break
            else:
                raise ValueError(f"cannot make {count} distinct {split} tool tasks (domain {domain})")
            seen.add(prompt)
            metadata = {"tools": draft.tools, **draft.services, "reference": draft.reference}
            tasks.append(
                Task(
                    id=f"tool-{split}-{i:05d}",
                    domain=domain,
                    prompt=prompt,
                    env="tool",
                    answer=draft.answer,
                    metadata=metadata,
                )
            )
    return splits
