"""Reward functions: outcome and process components, combined by weight, with reward-hacking guards.

A component is `fn(task, trajectory, **params) -> float | RewardResult`, named in config either from
`REWARD_COMPONENTS` or as `package.module:function`; `trl:package.module:function` adapts a TRL-style
batch function `f(prompts, completions, **columns) -> list[float | None]`. Each component is logged on its
own as `reward/<name>/mean`; each hacking guard as `reward/hacking/<kind>` (the fraction flagged).

Components that need more than the test verdicts declare it in `NEEDS` (`examples`: the program run on
the prompt's visible examples; `lint`: linter findings; `reference`: the reference solution's CPU time);
`rollout.code.execute` provides exactly what the configured components and guards need.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from tempering.algos import lookup
from tempering.registry import load_callable
from tempering.rewards.guards import GUARDS, detect, parse_quietly
from tempering.types import RewardResult, Task, Trajectory

RewardComponent = Callable[..., "float | RewardResult"]


def tests_passed(task: Task, traj: Trajectory, *, edge_weight: float = 1.0) -> float:
    """Outcome reward: the (weighted) fraction of hidden tests passed; tests tagged `edge` weigh `edge_weight`."""
    if traj.exec_result is None or not traj.exec_result.tests:
        return 0.0
    weights = [edge_weight if "edge" in t.tags else 1.0 for t in task.tests]
    passed = [r.passed for r in traj.exec_result.tests]
    return sum(w for w, p in zip(weights, passed) if p) / sum(weights)


def edge_cases(task: Task, traj: Trajectory) -> float:
    """Process reward: the fraction of tests tagged `edge` passed (of all tests when none is tagged)."""
    if traj.exec_result is None or not traj.exec_result.tests:
        return 0.0
    pairs = [(t, r) for t, r in zip(task.tests, traj.exec_result.tests) if "edge" in t.tags]
    if not pairs:
        return traj.exec_result.passed_fraction
    return sum(r.passed for _, r in pairs) / len(pairs)


def _parse(code: str) -> ast.Module | None:
    return parse_quietly(code)


def well_formed(task: Task, traj: Trajectory) -> float:
    """Format reward: the completion ended on its own, parses, and defines the entry point."""
    if traj.truncated or task.language != "python":
        return 0.0 if traj.truncated else 1.0
    tree = _parse(traj.program)
    if tree is None:
        return 0.0
    if task.entry_point is None:
        return 1.0
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return float(task.entry_point in defined)


def code_style(task: Task, traj: Trajectory) -> float:
    """Process reward: 1 / (1 + linter findings) for a program that parses (ruff: pyflakes, pycodestyle
    errors, bugbear); 0 for one that does not."""
    if traj.lint_findings is None:
        return 0.0
    return 1.0 / (1.0 + traj.lint_findings)


def efficiency(task: Task, traj: Trajectory, *, floor_s: float = 1e-3) -> float:
    """Process reward: min(1, reference CPU time / this program's CPU time) when every test passes, else 0.
    Times under `floor_s` are raised to it, so timer noise on trivial programs does not count."""
    r = traj.exec_result
    if r is None or not r.all_passed or traj.reference_cpu_s is None:
        return 0.0
    return min(1.0, max(traj.reference_cpu_s, floor_s) / max(r.cpu_time_s, floor_s))


def examples_passed(task: Task, traj: Trajectory) -> float:
    """The fraction of the prompt's *visible* examples passed. Deliberately hackable (a lookup of the
    shown cases earns it all): here to demonstrate the `hardcoded_examples` guard, not to train with."""
    r = traj.example_result
    return r.passed_fraction if r is not None else 0.0


def naive_harness(task: Task, traj: Trajectory) -> float:
    """Deliberately hackable: scores like a harness that appends the asserts to the program and trusts a
    clean exit status - a program that calls `exit(0)` before the tests gets full marks. Here to
    demonstrate the `exit_before_tests` guard (bench/hacking_demo.py), not to train with."""
    r = traj.exec_result
    if r is None:
        return 0.0
    if "exit_before_tests" in r.flags and r.exit_code == 0:
        return 1.0
    return r.passed_fraction


def overlong(task: Task, traj: Trajectory, *, max_tokens: int = 48, cache_tokens: int = 8) -> float:
    """DAPO's overlong reward shaping (arXiv 2503.14476): 0 up to max_tokens - cache_tokens, then falling
    linearly to -1 at max_tokens (and -1 beyond)."""
    excess = traj.response_tokens - (max_tokens - cache_tokens)
    if excess <= 0:
        return 0.0
    return -min(1.0, excess / max(cache_tokens, 1))


REWARD_COMPONENTS: dict[str, RewardComponent] = {
    "tests": tests_passed,
    "format": well_formed,
    "style": code_style,
    "efficiency": efficiency,
    "edge_cases": edge_cases,
    "overlong": overlong,
    "examples": examples_passed,
    "naive_harness": naive_harness,
}
NEEDS: dict[str, str] = {"style": "lint", "efficiency": "reference", "examples": "examples",
                         "hardcoded_examples": "examples"}


def trl_adapter(fn: Callable[..., list[float | None]]) -> Callable[[list[Trajectory]], list[float]]:
    """A TRL reward function `f(prompts, completions, **columns) -> list[float | None]` as a batch
    component. Columns are the task fields (id, domain, entry_point, tests, examples, metadata, ...);
    None (TRL: "not applicable to this sample") counts as 0."""

    def batch(trajectories: list[Trajectory]) -> list[float]:
        tasks = [t.task for t in trajectories]
        columns = {name: [getattr(task, name) for task in tasks] for name in Task.model_fields if name != "prompt"}
        scores = fn(prompts=[t.prompt for t in tasks], completions=[t.completion for t in trajectories], **columns)
        if len(scores) != len(trajectories):
            raise ValueError(f"TRL reward function returned {len(scores)} scores for {len(trajectories)} completions")
        return [0.0 if s is None else float(s) for s in scores]

    return batch


class RewardFunction:
    """sum_c weight_c * component_c, keeping every component's value; then the hacking guards.

    With `guards` on, a trajectory caught by a guard gets `penalty` as its reward instead; detections are
    recorded in `info["hacking"]` either way, so a run with guards off still shows what it learned.
    """

    def __init__(self, weights: Mapping[str, float], *, params: Mapping[str, Mapping[str, Any]] | None = None,
                 guards: bool = True, guard_kinds: list[str] | None = None, penalty: float = -1.0,
                 step_fn: str | None = None):
        if not weights:
            raise ValueError("reward.weights is empty; name at least one component")
        self.weights = dict(weights)
        self.params = {k: dict(v) for k, v in (params or {}).items()}
        unknown = set(self.params) - set(self.weights)
        if unknown:
            raise ValueError(f"reward.params names component(s) {sorted(unknown)} that reward.weights does not use")
        self.components: dict[str, RewardComponent] = {}
        self.batch_components: dict[str, Callable[[list[Trajectory]], list[float]]] = {}
        for name in self.weights:
            if name.startswith("trl:"):
                self.batch_components[name] = trl_adapter(load_callable(name[4:], "TRL reward function"))
            else:
                self.components[name] = lookup(REWARD_COMPONENTS, name, "reward component")
        kinds = list(GUARDS) if guard_kinds is None else list(guard_kinds)
        bad = set(kinds) - set(GUARDS)
        if bad:
            raise ValueError(f"unknown reward guard(s) {sorted(bad)}; valid: {', '.join(GUARDS)}")
        self.guard_kinds, self.guards, self.penalty = kinds, guards, penalty
        self.step_fn = load_callable(step_fn, "step reward function") if step_fn else None

    @property
    def needs(self) -> set[str]:
        """What execution must provide beyond the test verdicts."""
        return {NEEDS[n] for n in list(self.weights) + self.guard_kinds if n in NEEDS}

    def __call__(self, task: Task, traj: Trajectory) -> RewardResult:
        return self.batch([traj])[0]

    def batch(self, trajectories: list[Trajectory]) -> list[RewardResult]:
        batch_scores = {name: fn(trajectories) for name, fn in self.batch_components.items()}
        results = []
        for i, traj in enumerate(trajectories):
            components: dict[str, float] = {}
            info: dict[str, Any] = {}
            for name, fn in self.components.items():
                value = fn(traj.task, traj, **self.params.get(name, {}))
                if isinstance(value, RewardResult):
                    info.update(value.info)
                    value = value.score
                components[name] = float(value)
            for name, scores in batch_scores.items():
                components[name] = scores[i]
            score = sum(self.weights[n] * v for n, v in components.items())
            hacks = detect(traj.task, traj, self.guard_kinds)
            info["hacking"] = hacks
            if hacks and self.guards:
                score = self.penalty
            if self.step_fn is not None:
                info["step_rewards"] = self.step_rewards(traj)
            results.append(RewardResult(score=score, components=components, info=info))
        return results

    def step_rewards(self, traj: Trajectory) -> list[float]:
        """The process-reward hook: `step_fn(task, steps) -> one score per step`, where the steps are the
        completion's lines (single-turn) or turns (episodes); credited at each step's last token."""
        steps = step_texts(traj)
        kwargs = {"trajectory": traj} if "trajectory" in inspect.signature(self.step_fn).parameters else {}
        scores = list(self.step_fn(traj.task, steps, **kwargs))
        if len(scores) != len(steps):
            raise ValueError(f"step reward function returned {len(scores)} scores for {len(steps)} steps")
        return [float(s) for s in scores]


def step_texts(traj: Trajectory) -> list[str]:
    """A single-turn completion's steps: its lines, each with its newline (the last may lack one)."""
    return traj.completion.splitlines(keepends=True) or [traj.completion]


__all__ = ["GUARDS", "NEEDS", "REWARD_COMPONENTS", "RewardFunction", "code_style", "edge_cases", "efficiency",
           "examples_passed", "naive_harness", "overlong", "step_texts", "tests_passed", "trl_adapter", "well_formed"]
