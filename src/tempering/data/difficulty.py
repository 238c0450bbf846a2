"""Task difficulty as the start model sees it: its own pass rate per task family, measured once before a run
(`tempering data pass-rates CONFIG`), then used to keep the tasks it can partly solve (`data.pass_rates`,
`data.pass_range`). RL learns from groups whose samples differ; a family the model never (or always) solves
gives all-equal groups, no advantage and no gradient, only cost.

A family is the generator's template (`add`, `reverse_list`: every function of it, train and held-out), a
reasoning-gym dataset, or, for other tasks (a file's), the task itself. The measurement also gives each
domain's rates: pass@1 over all samples and pass@k, the share of tasks solved by at least one of k samples.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tempering.errors import ConfigError
from tempering.types import Task


def family(task: Task) -> str:
    return str(task.metadata.get("template") or task.metadata.get("dataset") or task.id)


def pick_per_family(tasks: list[Task], per_family: int) -> list[Task]:
    """The first `per_family` tasks of each family, in the tasks' order."""
    taken: dict[str, int] = defaultdict(int)
    out = []
    for task in tasks:
        if taken[family(task)] < per_family:
            taken[family(task)] += 1
            out.append(task)
    return out


def family_rates(
    tasks: list[Task], correct: dict[str, int], samples: int, key: Callable[[Task], str] = family
) -> dict[str, dict[str, float]]:
    """{family (or `key`): {pass_rate, pass@k, tasks}} from correct samples per task id (an evaluation's
    `per_task`, k = `samples`)."""
    by: dict[str, list[int]] = defaultdict(list)
    for task in tasks:
        by[key(task)].append(correct[task.id])
    return {
        k: {
            "pass_rate": sum(v) / (samples * len(v)),
            "pass@k": sum(c > 0 for c in v) / len(v),
            "tasks": len(v),
        }
        for k, v in sorted(by.items())
    }


def load_pass_rates(path: str | Path, key: str = "pass_rate") -> dict[str, float]:
    """{family: pass rate} (`key`: pass_rate or pass@k) of a `tempering data pass-rates` file; a clear
    error for anything else."""
    path = Path(path)
    try:
        data: Any = json.loads(path.read_text())
        rates = {str(k): float(v[key]) for k, v in data["families"].items()}
    except FileNotFoundError:
        raise ConfigError(
            f"data.pass_rates: file '{path}' does not exist (write it with "
            "`tempering data pass-rates CONFIG --out FILE`)"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"data.pass_rates: '{path}' is not a pass-rates file ({type(e).__name__}: {e})"
        ) from None
    return rates


def kept(name: str, rates: dict[str, float], low: float, high: float) -> bool:
    """A family stays when its measured pass rate lies in [low, high], or when it was not measured."""
    return name not in rates or low <= rates[name] <= high


def in_range(tasks: list[Task], rates: dict[str, float], low: float, high: float) -> list[Task]:
    """The tasks whose family stays (`kept`)."""
    return [t for t in tasks if kept(family(t), rates, low, high)]
