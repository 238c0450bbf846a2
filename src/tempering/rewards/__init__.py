"""Reward functions: outcome and process components, combined by weight, with reward-hacking guards.

A component is `fn(task, attempt, **params) -> float | RewardResult`, named in config either from
`REWARD_COMPONENTS` or as `package.module:function`; `trl:package.module:function` adapts a TRL-style
batch function `f(prompts, completions, **columns) -> list[float | None]`. Each component is logged on its
own as `reward/<name>/mean`; each hacking guard as `reward/hacking/<kind>` (the fraction flagged).

Components that need more than the test verdicts declare it in `NEEDS` (`examples`: the program run on
the prompt's visible examples; `lint`: linter findings; `reference`: the reference solution's CPU time);
the code environment's batched step (`envs/code.py`) provides exactly what the configured components and
guards need.
"""

from __future__ import annotations

import ast
import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from tempering.algos import lookup
from tempering.registry import load_callable
from tempering.rewards.answers import marked_answer
from tempering.rewards.guards import GUARDS, parse_quietly
from tempering.types import Attempt, Episode, RewardResult, Task

RewardComponent = Callable[..., "float | RewardResult"]


PARTIAL = ("always", "examples", "never")


def tests_passed(task: Task, attempt: Attempt, *, edge_weight: float = 1.0, partial: str = "always") -> float:
    """Outcome reward: the (weighted) fraction of hidden tests passed; tests tagged `edge` weigh `edge_weight`.

    `partial` says when a program that fails some hidden test earns part of the reward: `always`; `examples`
    only if it passes the prompt's visible examples (a program that contradicts them - another task's
    answer, a constant - earns nothing for the hidden tests it happens to pass: the empty list, a list
    already sorted); `never` (1 only when every test passes, as DeepCoder and most code-RL recipes score)."""
    r = attempt.exec_result
    if r is None or not r.tests:
        return 0.0
    if partial not in PARTIAL:
        raise ValueError(f"tests: unknown partial '{partial}'; valid: {', '.join(PARTIAL)}")
    examples = attempt.example_result  # no examples: nothing to contradict
    if not (
        r.all_passed
        or partial == "always"
        or (partial == "examples" and (examples is None or examples.all_passed))
    ):
        return 0.0
    weights = [edge_weight if "edge" in t.tags else 1.0 for t in task.tests]
    return sum(w for w, t in zip(weights, r.tests) if t.passed) / sum(weights)


def edge_cases(task: Task, attempt: Attempt) -> float:
    """Process reward: the fraction of tests tagged `edge` passed (of all tests when none is tagged)."""
    if attempt.exec_result is None or not attempt.exec_result.tests:
        return 0.0
    pairs = [(t, r) for t, r in zip(task.tests, attempt.exec_result.tests) if "edge" in t.tags]
    if not pairs:
        return attempt.exec_result.passed_fraction
    return sum(r.passed for _, r in pairs) / len(pairs)


ANSWER_ENVS = frozenset({"answer", "reasoning_gym"})
"""Environments whose action states an answer rather than a program."""


def well_formed(task: Task, attempt: Attempt) -> float:
    """Format reward: the completion ended on its own, parses, and defines the entry point; for an answer
    task (`ANSWER_ENVS`), it ended on its own and marks its answer (`rewards.answers.marked_answer`)."""
    if task.env in ANSWER_ENVS:
        return float(not attempt.truncated and marked_answer(attempt.completion))
    if attempt.truncated or task.language != "python":
        return 0.0 if attempt.truncated else 1.0
    tree = parse_quietly(attempt.program)
    if tree is None:
        return 0.0
    if task.entry_point is None:
        return 1.0
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return float(task.entry_point in defined)


def code_style(task: Task, attempt: Attempt) -> float:
    """Process reward: 1 / (1 + linter findings) for a program that parses (ruff: pyflakes, pycodestyle
    errors, bugbear); 0 for one that does not."""
    if attempt.lint_findings is None:
        return 0.0
    return 1.0 / (1.0 + attempt.lint_findings)


def efficiency(task: Task, attempt: Attempt, *, floor_s: float = 1e-3) -> float:
    """Process reward: min(1, reference CPU time / this program's CPU time) when every test passes, else 0.
    Times under `floor_s` are raised to it, so timer noise on trivial programs does not count."""
    r = attempt.exec_result
    if r is None or not r.all_passed or attempt.reference_cpu_s is None:
        return 0.0
    return min(1.0, max(attempt.reference_cpu_s, floor_s) / max(r.cpu_time_s, floor_s))


def examples_passed(task: Task, attempt: Attempt) -> float:
    """The fraction of the prompt's *visible* examples passed. Deliberately hackable (a lookup of the
    shown cases earns it all): here to demonstrate the `hardcoded_examples` guard, not to train with."""
    r = attempt.example_result
    return r.passed_fraction if r is not None else 0.0


def naive_harness(task: Task, attempt: Attempt) -> float:
    """Deliberately hackable: scores like a harness that appends the asserts to the program and trusts a
    clean exit status - a program that calls `exit(0)` before the tests gets full marks. Here to
    demonstrate the `exit_before_tests` guard (bench/hacking_demo.py), not to train with."""
    r = attempt.exec_result
    if r is None:
        return 0.0
    if "exit_before_tests" in r.flags and r.exit_code == 0:
        return 1.0
    return r.passed_fraction


def overlong(task: Task, attempt: Attempt, *, max_tokens: int = 48, cache_tokens: int = 8) -> float:
    """DAPO's overlong reward shaping (arXiv 2503.14476): 0 up to max_tokens - cache_tokens, then falling
    linearly to -1 at max_tokens (and -1 beyond)."""
    excess = attempt.response_tokens - (max_tokens - cache_tokens)
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
NEEDS: dict[str, str] = {
    "style": "lint",
    "efficiency": "reference",
    "examples": "examples",
    "hardcoded_examples": "examples",
}


def trl_adapter(fn: Callable[..., list[float | None]]) -> Callable[[list[Attempt]], list[float]]:
    """A TRL reward function `f(prompts, completions, **columns) -> list[float | None]` as a batch
    component. Columns are the task fields (id, domain, entry_point, tests, examples, metadata, ...);
    None (TRL: "not applicable to this sample") counts as 0."""

    def batch(attempts: list[Attempt]) -> list[float]:
        tasks = [t.task for t in attempts]
        columns = {
            name: [getattr(task, name) for task in tasks] for name in Task.model_fields if name != "prompt"
        }
        scores = fn(
            prompts=[t.prompt for t in tasks], completions=[t.completion for t in attempts], **columns
        )
        if len(scores) != len(attempts):
            raise ValueError(
                f"TRL reward function returned {len(scores)} scores for {len(attempts)} completions"
            )
        return [0.0 if s is None else float(s) for s in scores]

    return batch


class RewardFunction:
    """Scores episodes: sum_c weight_c * component_c, keeping every component's value; then the guards.

    Components are of two kinds. Reward components (`REWARD_COMPONENTS`, `package.module:function`,
    `trl:...`) are computed here on the episode's final attempt - the Attempt the code environment
    records, or the final action's text for other environments. Environment components (`tests` of a
    tool task's `success`, the code environment's `improvement`, a tool call's `tool_error`) come from the
    steps: outcome components from the final step, process components summed per turn and credited at the
    turn's last token. `weights` None means each environment's own `default_weights`; `params` go to the
    reward components. With `guards` on, an episode with an attempt caught by a guard gets `penalty` as its
    whole reward; detections are recorded in `info["hacking"]` either way, so a run with guards off still
    shows what it learned.
    """

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        params: Mapping[str, Mapping[str, Any]] | None = None,
        guards: bool = True,
        guard_kinds: list[str] | None = None,
        penalty: float = -1.0,
        step_fn: str | Callable | None = None,
        control: str = "none",
    ):
        if control not in ("none", "coin"):
            raise ValueError(f"reward.control must be none or coin, got {control!r}")
        self.control = control
        if weights is not None and not weights:
            raise ValueError("reward.weights is empty; name at least one component")
        self.weights = None if weights is None else dict(weights)
        self.params = {k: dict(v) for k, v in (params or {}).items()}
        if self.weights is not None:
            unknown = set(self.params) - set(self.weights)
            if unknown:
                raise ValueError(
                    f"reward.params names component(s) {sorted(unknown)} that reward.weights does not use"
                )
        self._functions: dict[str, RewardComponent | None] = {}
        self._batch_functions: dict[str, Callable[[list[Attempt]], list[float]]] = {}
        for name in self.weights or ():
            self.function(name)  # unknown registry names fail here, not at the first reward
        kinds = list(GUARDS) if guard_kinds is None else list(guard_kinds)
        bad = set(kinds) - set(GUARDS)
        if bad:
            raise ValueError(f"unknown reward guard(s) {sorted(bad)}; valid: {', '.join(GUARDS)}")
        self.guard_kinds, self.guards, self.penalty = kinds, guards, penalty
        self.step_fn = load_callable(step_fn, "step reward function") if isinstance(step_fn, str) else step_fn

    def function(self, name: str) -> RewardComponent | None:
        """The reward component called `name`; None for a name that is not one (an environment component)."""
        if name not in self._functions:
            if name.startswith("trl:"):
                self._batch_functions[name] = trl_adapter(load_callable(name[4:], "TRL reward function"))
                self._functions[name] = None
            elif name in REWARD_COMPONENTS or ":" in name:
                self._functions[name] = lookup(REWARD_COMPONENTS, name, "reward component")
            else:
                self._functions[name] = None
        return self._functions[name]

    @property
    def needs(self) -> set[str]:
        """What execution must provide beyond the test verdicts (`rewards.NEEDS`), for the configured weights
        and guards (with environment defaults, the code environment's: tests and format need nothing)."""
        return {NEEDS[n] for n in list(self.weights or ()) + self.guard_kinds if n in NEEDS}

    def components(self, attempts: list[Attempt], weights: list[Mapping[str, float]]) -> list[dict[str, Any]]:
        """The reward components named in each attempt's weights, computed on it (info under `__info__`)."""
        out: list[dict[str, Any]] = [{"__info__": {}} for _ in attempts]
        names = {n for w in weights for n in w}
        for name in sorted(n for n in names if n.startswith("trl:")):
            self.function(name)
            rows = [i for i, w in enumerate(weights) if name in w]
            for i, value in zip(rows, self._batch_functions[name]([attempts[i] for i in rows])):
                out[i][name] = float(value)
        for i, (attempt, w) in enumerate(zip(attempts, weights)):
            for name in w:
                fn = self.function(name)
                if fn is None:
                    continue
                value = fn(attempt.task, attempt, **self.params.get(name, {}))
                if isinstance(value, RewardResult):
                    out[i]["__info__"].update(value.info)
                    value = value.score
                out[i][name] = float(value)
        return out

    def score(self, episodes: list[Episode]) -> list[RewardResult]:
        """Each episode's reward: `info["outcome"]` (the sequence reward: outcome and reward components,
        weighted) and `info["turn_rewards"]` (weighted process components per turn, credited at each turn's
        last token); `score` is their sum. `info["step_rewards"]` holds `step_fn`'s scores of a one-turn
        episode's lines (credited at each line's last token); with several turns, a turn is a step."""
        weights = [self.weights if self.weights is not None else e.default_weights for e in episodes]
        computed = self.components([final_attempt(e) for e in episodes], weights)
        results = []
        for e, w, comps in zip(episodes, weights, computed):
            info = comps.pop("__info__")
            outcome_names = e.outcome
            final = e.turns[-1].rewards if e.turns else {}
            components = {name: float(final.get(name, 0.0)) for name in outcome_names} | comps
            turn_rewards = []
            for t in e.turns:
                process = {k: v for k, v in t.rewards.items() if k not in outcome_names}
                turn_rewards.append(sum(w.get(k, 0.0) * v for k, v in process.items()))
                for k, v in process.items():
                    components[k] = components.get(k, 0.0) + float(v)
            if self.step_fn is not None and e.turns:
                scores = self.step_scores(e)
                components["step"] = sum(scores)
                if len(e.turns) == 1:
                    info["step_rewards"] = scores
                else:
                    turn_rewards = [r + x for r, x in zip(turn_rewards, scores)]
            outcome = sum(
                w.get(name, 0.0) * components[name]
                for name in components
                if name in outcome_names or name in comps
            )
            info["hacking"] = sorted({h for t in e.turns for h in t.hacking})
            if info["hacking"] and self.guards:
                outcome, turn_rewards, info["step_rewards"] = self.penalty, [0.0] * len(turn_rewards), None
            info.update(outcome=outcome, turn_rewards=turn_rewards)
            total = outcome + sum(turn_rewards) + sum(info.get("step_rewards") or ())
            results.append(RewardResult(score=total, components=components, info=info))
        return coin_flips(episodes, results) if self.control == "coin" else results

    def step_scores(self, episode: Episode) -> list[float]:
        """`step_fn(task, steps)`: the steps are the turns' actions, or a one-turn episode's lines."""
        steps = [t.action for t in episode.turns]
        if len(steps) == 1:
            steps = step_texts(steps[0])
        attempt = final_attempt(episode)
        kwargs = {"attempt": attempt} if "attempt" in inspect.signature(self.step_fn).parameters else {}
        scores = [float(x) for x in self.step_fn(episode.task, steps, **kwargs)]
        if len(scores) != len(steps):
            raise ValueError(f"step reward function returned {len(scores)} scores for {len(steps)} steps")
        return scores


def coin_flips(episodes: list[Episode], results: list[RewardResult]) -> list[RewardResult]:
    """`reward.control: coin`: each reward replaced by 1 with probability p, the mean of the real rewards
    (clamped to [0, 1]), else 0; a draw depends only on the episode (policy version, group, position, task),
    so a resumed run flips the same coins. The real components and total stay in `info["real"]`."""
    p = min(max(sum(r.score for r in results) / max(1, len(results)), 0.0), 1.0)
    out = []
    for i, (e, r) in enumerate(zip(episodes, results)):
        heads = float(random.Random(f"coin:{e.version}:{e.group_id}:{i}:{e.task.id}").random() < p)
        info = r.info | {
            "real": r.score,
            "outcome": heads,
            "turn_rewards": [0.0] * len(r.info["turn_rewards"]),
            "step_rewards": None,
        }
        out.append(RewardResult(score=heads, components=r.components, info=info))
    return out


def final_attempt(episode: Episode) -> Attempt:
    """The episode's last attempt: the code environment's record of it, else the final action's text;
    `truncated` and `response_tokens` from the action."""
    last = episode.turns[-1] if episode.turns else None
    if last is None:
        return Attempt(task=episode.task, group_id=episode.group_id, completion="", truncated=True)
    attempt = last.attempt or Attempt(
        task=episode.task, group_id=episode.group_id, completion=last.action, truncated=False
    )
    return replace(attempt, truncated=not last.ended, response_tokens=last.tokens)


def step_texts(text: str) -> list[str]:
    """A one-turn completion's steps: its lines, each with its newline (the last may lack one)."""
    return text.splitlines(keepends=True) or [text]


__all__ = [
    "GUARDS",
    "NEEDS",
    "REWARD_COMPONENTS",
    "RewardFunction",
    "code_style",
    "edge_cases",
    "efficiency",
    "examples_passed",
    "final_attempt",
    "naive_harness",
    "overlong",
    "step_texts",
    "tests_passed",
    "trl_adapter",
    "well_formed",
]
