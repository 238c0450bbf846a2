"""95% confidence intervals of held-out pass@1 by the bootstrap over problems (Efron's percentile
interval): the tasks are what is sampled from a population, so they are what is resampled. A before/after
gain is bootstrapped paired - the same resampled problems on both sides - which is much tighter than two
separate intervals, because a problem's difficulty cancels."""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000


def bootstrap_ci(values, *, level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> list[float]:
    """[low, high] of the mean of `values` (one number per problem)."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return [float("nan"), float("nan")]
    idx = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    means = x[idx].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    return [float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))]


def paired_gain(
    before, after, *, level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0
) -> list[float]:
    """[gain, low, high]: the mean of after - before over the same problems, and its interval."""
    diff = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    return [
        float(diff.mean()) if len(diff) else float("nan"),
        *bootstrap_ci(diff, level=level, resamples=resamples, seed=seed),
    ]


def pass_intervals(before: dict[str, float], after: dict[str, float], domains: dict[str, str]) -> dict:
    """Intervals of pass@1 before and after, and of the gain, overall and per domain. `before` / `after`:
    task id -> that task's pass@1 (correct samples / samples); `domains`: task id -> domain."""
    ids = [t for t in before if t in after]

    def block(keep: list[str]) -> dict:
        b, a = [before[t] for t in keep], [after[t] for t in keep]
        return {
            "before": bootstrap_ci(b),
            "after": bootstrap_ci(a),
            "gain": paired_gain(b, a),
            "tasks": len(keep),
        }

    out = {"all": block(ids)}
    for domain in sorted({domains.get(t, "") for t in ids}):
        out[domain] = block([t for t in ids if domains.get(t, "") == domain])
    return out


def format_gain(gain: list[float] | None) -> str:
    """`[gain, low, high]` (fractions) as points: "+8.1 [+6.1, +10.3]"; "" when there is none."""
    return f"{gain[0] * 100:+.1f} [{gain[1] * 100:+.1f}, {gain[2] * 100:+.1f}]" if gain else ""
