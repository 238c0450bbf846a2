"""reasoning-gym adapter: ~100 procedural task families with verifiers (`pip install 'tempering[gym]'`).

`gym_tasks` turns dataset entries into tasks (one domain per dataset; the entry is kept in the task's
metadata, so a task file scores without the generator's state) and `GymEnv` scores an answer with the
dataset's own verifier. What the adapter fixes (measured on reasoning-gym 0.1.25 over all 106 datasets):
`composite` is a mixer, not a task family, and is left out; `list_functions` draws from the global
`random` module, so it is seeded per entry; `arc_agi`/`rearc` compare tuples that JSON turns into lists;
`game_of_life_halting`'s verifier gives full credit to any non-empty answer and is replaced by an exact
match; a verifier that raises on a malformed answer scores 0. Not fixed: five generators
(isomorphic_strings, knight_swap, polynomial_multiplication, ransom_note, word_ladder) iterate over sets of
strings, so their tasks depend on PYTHONHASHSEED; a run directory keeps the tasks it generated
(RUN_DIR/data), so its resumes see the same ones - set PYTHONHASHSEED for identical sets across runs.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

from tempering.envs.answer import AnswerEnv, answers_match
from tempering.envs.base import register
from tempering.types import Task

EXCLUDED = {"composite"}
"""Datasets that are not task families."""


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("reasoning-gym is not installed: pip install 'tempering[gym]' (or reasoning-gym)") from None
    return reasoning_gym


def gym_datasets() -> list[str]:
    """Every registered reasoning-gym dataset usable as a domain."""
    return sorted(set(_rg().factory.DATASETS) - EXCLUDED)


@functools.lru_cache(maxsize=512)
def _scorer(name: str, config_json: str):
    return _rg().create_dataset(name, seed=0, size=1, **json.loads(config_json)).score_answer


def _restore(entry: dict[str, Any]) -> dict[str, Any]:
    """Undo what a JSON round trip changed in an entry."""
    meta = entry.get("metadata", {})
    if isinstance(meta.get("output"), list) and meta.get("source_dataset") in ("arc_agi", "rearc"):
        entry = {**entry, "metadata": {**meta, "output": tuple(map(tuple, meta["output"]))}}
    return entry


def score_gym_answer(task: Task, answer: str) -> float:
    """The dataset's verifier on `answer`, in [0, 1]."""
    name, entry = task.metadata["dataset"], _restore(task.metadata["entry"])
    if name == "game_of_life_halting":
        return float(answers_match(answer, entry["answer"]))
    try:
        score = _scorer(name, json.dumps(task.metadata.get("config", {}), sort_keys=True))(answer, entry)
    except Exception:  # noqa: BLE001 - a verifier crashing on a malformed answer is a wrong answer
        return 0.0
    return float(score or 0.0)


@register
class GymEnv(AnswerEnv):
    """An answer-matching episode judged by the dataset's verifier (partial credit allowed; success = 1.0)."""

    kind = "reasoning_gym"

    def judge(self, answer: str) -> tuple[float, str]:
        return score_gym_answer(self.task, answer), "incorrect"


def gym_tasks(datasets: list[str] | None, per_domain_train: int, per_domain_heldout: int, seed: int,
              config: dict[str, dict[str, Any]] | None = None, max_prompt_chars: int = 600,
              ) -> tuple[list[Task], list[Task]]:
    """Tasks from each dataset (None = all); one domain per dataset. Entries whose question is longer than
    `max_prompt_chars` are skipped (a small model's context), and held-out questions that also occur in
    training are dropped. Raises ValueError naming an unknown dataset."""
    rg = _rg()
    names = gym_datasets() if datasets is None else list(datasets)
    unknown = [n for n in names if n not in rg.factory.DATASETS or n in EXCLUDED]
    if unknown:
        raise ValueError(f"unknown reasoning-gym dataset(s) {unknown}; e.g. {', '.join(gym_datasets()[:8])}, ...")
    train: list[Task] = []
    heldout: list[Task] = []
    for name in names:
        kwargs = (config or {}).get(name, {})
        want = per_domain_train + per_domain_heldout
        ds = rg.create_dataset(name, seed=seed, size=4 * want, **kwargs)
        picked: list[Task] = []
        seen: set[str] = set()
        for i in range(4 * want):
            if len(picked) == want:
                break
            random.seed(f"{seed}:{name}:{i}")  # list_functions draws from the global generator
            entry = json.loads(json.dumps(ds[i], default=str))
            question = entry["question"]
            if len(question) > max_prompt_chars or question in seen:
                continue
            seen.add(question)
            picked.append(Task(id=f"{name}-{i}", domain=name, env="reasoning_gym", prompt=f"{question}\nAnswer: ",
                               answer=entry.get("answer"), reference_solution=entry.get("answer"),
                               metadata={"dataset": name, "entry": entry, "config": kwargs}))
        cut = min(per_domain_train, max(1, len(picked) - per_domain_heldout)) if picked else 0
        train += picked[:cut]
        heldout += picked[cut:]
    return train, heldout
