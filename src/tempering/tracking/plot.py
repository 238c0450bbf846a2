"""A PNG of a run: training reward per step and held-out pass@1 at each validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_run(
    rows: list[dict[str, Any]],
    path: Path,
    *,
    before: dict[str, float] | None = None,
    after: dict[str, float] | None = None,
    temperature: float = 1.0,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if r.get("reward/mean") is not None]
    reward = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, reward, lw=0.8, alpha=0.5, label="reward/mean")
    if len(reward) >= 10:
        w = 10
        smooth = [
            sum(reward[max(0, i - w + 1) : i + 1]) / len(reward[max(0, i - w + 1) : i + 1])
            for i in range(len(reward))
        ]
        ax1.plot(steps, smooth, lw=2, label="10-step mean")
    ax1.set_xlabel("RL step")
    ax1.set_title("training reward")
    ax1.legend()

    for key, label in (("val/pass@1", f"sampled T={temperature:g}"), ("val/greedy_pass@1", "greedy")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if before and key in before:
            pts = [(0, before[key]), *pts]
        if after and key in after and steps:
            pts = [*pts, (steps[-1], after[key])]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax2.set_xlabel("RL step")
    ax2.set_title("held-out pass@1")
    ax2.set_ylim(0, 1)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
