"""The domain monitor of a mixture run: at each periodic validation it compares every domain's held-out
pass@1 with the best that domain reached at an earlier validation, and acts on a domain that fell.

A domain *falls past its interval* when the whole 95% interval of its pass@1 now (bootstrap over its
validation tasks, `eval.intervals`) lies below its best earlier pass@1: not a dip within noise, a drop the
validation tasks themselves rule out. Such a domain is logged as an alert (a line, the row's
`monitor/<domain>/alert`, summary.json's `monitor`) and its mixture weight multiplied by
`eval.monitor_boost`, up to `MAX_BOOST` times its configured weight, so the next steps draw more of its
tasks; once its interval reaches its best again, its configured weight returns.

Unless its training reward did not fall with it: a domain whose mean training reward since the last
validation is at least what it was when the domain reached its best, while its held-out pass@1 fell, is
being paid for something other than solving its tasks (a SmolLM2 run learned to answer GCDs with `21`,
which a substring-crediting verifier paid 0.5). Drawing more of its tasks would pay the exploit more, so
such an alert is marked `suspect` (`monitor/<domain>/suspect`, "reward held: check the reward") and the
weight is left as it is. The best values, the reward windows and the sampler's weights are checkpointed:
a resumed run acts as the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tempering.eval.intervals import bootstrap_ci

MAX_BOOST = 8.0
"""A domain's weight is raised to at most this many times its configured weight."""


@dataclass(frozen=True)
class Alert:
    step: int
    domain: str
    pass_at_1: float
    interval: tuple[float, float]
    best: float
    best_step: int
    weight: float
    """The domain's mixture weight after the monitor acted."""
    suspect: bool = False
    """Its training reward held while its pass@1 fell: the weight was not raised."""

    def line(self) -> str:
        low, high = self.interval
        acted = (
            "its training reward held: check the reward for an exploit; mixture weight left at "
            if self.suspect
            else "mixture weight now "
        )
        return (
            f"monitor: {self.domain} fell to {self.pass_at_1:.1%} [{low:.1%}, {high:.1%}] at step {self.step}, "
            f"below its best {self.best:.1%} (step {self.best_step}); {acted}{self.weight:g}"
        )


class Mixture(Protocol):
    weights: dict[str, float]
    """{domain: weight} the next draws use (`data.sampler.MixtureSampler`)."""
    base: dict[str, float]
    """The configured weights."""


class DomainMonitor:
    """Watches per-domain validation results and sets the weights of `mixture`."""

    def __init__(self, mixture: Mixture, boost: float):
        if boost < 1.0:
            raise ValueError(f"eval.monitor_boost must be at least 1, got {boost}")
        self.mixture, self.boost = mixture, boost
        self.best: dict[str, tuple[float, int]] = {}  # domain -> (best pass@1, its step)
        self.window: dict[str, list[float]] = {}  # domain -> [reward sum, steps] since the last validation
        self.reward_at_best: dict[str, float] = {}  # domain -> its window's mean reward at its best

    def record(self, metrics: dict[str, float]) -> None:
        """A step's row: each mixed domain's `reward/<domain>/mean` joins the current window."""
        for domain in self.mixture.weights:
            value = metrics.get(f"reward/{domain}/mean")
            if value is not None:
                total = self.window.setdefault(domain, [0.0, 0.0])
                total[0], total[1] = total[0] + value, total[1] + 1

    def observe(self, step: int, per_task: dict[str, list[float]]) -> list[Alert]:
        """`per_task`: {domain: each validation task's pass@1}. Returns the alerts of this validation."""
        alerts, weights, base = [], self.mixture.weights, self.mixture.base
        windows, self.window = self.window, {}
        for domain, values in sorted(per_task.items()):
            if domain not in weights or not values:
                continue
            mean = sum(values) / len(values)
            low, high = bootstrap_ci(values, seed=step)
            best, best_step = self.best.get(domain, (mean, step))
            total, steps = windows.get(domain, (0.0, 0.0))
            reward = total / steps if steps else None
            if high < best:
                at_best = self.reward_at_best.get(domain)
                suspect = reward is not None and at_best is not None and reward >= at_best
                if not suspect:
                    weights[domain] = min(weights[domain] * self.boost, base[domain] * MAX_BOOST)
                alerts.append(
                    Alert(step, domain, mean, (low, high), best, best_step, weights[domain], suspect)
                )
                continue
            weights[domain] = base[domain]
            if mean >= best:
                self.best[domain] = (mean, step)
                if reward is not None:
                    self.reward_at_best[domain] = reward
        return alerts

    def metrics(self, alerts: list[Alert]) -> dict[str, float]:
        """The validation row's `monitor/...` entries."""
        out = {"monitor/alerts": float(len(alerts))}
        out |= {f"monitor/{a.domain}/alert": 1.0 for a in alerts}
        out |= {f"monitor/{a.domain}/suspect": 1.0 for a in alerts if a.suspect}
        out |= {f"monitor/{d}/weight": w for d, w in self.mixture.weights.items()}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": {d: list(v) for d, v in self.best.items()},
            "window": {d: list(v) for d, v in self.window.items()},
            "reward_at_best": dict(self.reward_at_best),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = {d: (float(v[0]), int(v[1])) for d, v in state.get("best", {}).items()}
        self.window = {d: [float(v[0]), float(v[1])] for d, v in state.get("window", {}).items()}
        self.reward_at_best = {d: float(v) for d, v in state.get("reward_at_best", {}).items()}


def alerts_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alerts recorded in a run's metrics rows (summary.json's `monitor`): step, domain, its pass@1 then
    and its mixture weight after."""
    out = []
    for row in rows:
        for key in sorted(k for k in row if k.startswith("monitor/") and k.endswith("/alert")):
            domain = key.split("/")[1]
            out.append(
                {
                    "step": row.get("step"),
                    "domain": domain,
                    "pass@1": row.get(f"val/{domain}/pass@1"),
                    "weight": row.get(f"monitor/{domain}/weight"),
                    "suspect": bool(row.get(f"monitor/{domain}/suspect")),
                }
            )
    return out
