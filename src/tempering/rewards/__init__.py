"""Reward functions: `fn(task, trajectory) -> float | RewardResult`, combined by weight.

Each component is logged on its own as `reward/<name>/mean`. A component is a name from
`REWARD_COMPONENTS` or a user callable named as `package.module:function`.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Callable, Mapping

from tempering.algos import lookup
from tempering.types import RewardResult, Task, Trajectory

RewardComponent = Callable[[Task, Trajectory], "float | RewardResult"]


def tests_passed(task: Task, traj: Trajectory) -> float:
    """Outcome reward: the fraction of hidden tests the program passed."""
    return traj.exec_result.passed_fraction if traj.exec_result else 0.0


def well_formed(task: Task, traj: Trajectory) -> float:
    """Format reward: the completion ended on its own, parses as Python, and defines the entry point."""
    if traj.truncated:
        return 0.0
    try:
        with warnings.catch_warnings():  # model text often has e.g. `1if`; its SyntaxWarnings are noise
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(traj.program)
    except (SyntaxError, ValueError):
        return 0.0
    if task.entry_point is None:
        return 1.0
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return float(task.entry_point in defined)


REWARD_COMPONENTS: dict[str, RewardComponent] = {
    "tests": tests_passed,
    "format": well_formed,
}


class RewardFunction:
    """sum_c weight_c * component_c(task, trajectory), keeping every component's value."""

    def __init__(self, weights: Mapping[str, float]):
        if not weights:
            raise ValueError("reward.weights is empty; name at least one component")
        self.weights = dict(weights)
        self.components = {name: lookup(REWARD_COMPONENTS, name, "reward component") for name in self.weights}

    def __call__(self, task: Task, traj: Trajectory) -> RewardResult:
        components: dict[str, float] = {}
        info: dict = {}
        for name, fn in self.components.items():
            value = fn(task, traj)
            if isinstance(value, RewardResult):
                info.update(value.info)
                value = value.score
            components[name] = float(value)
        score = sum(self.weights[n] * v for n, v in components.items())
        return RewardResult(score=score, components=components, info=info)


__all__ = ["REWARD_COMPONENTS", "RewardFunction", "tests_passed", "well_formed"]
