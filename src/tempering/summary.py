"""The end of a run: `summary.json` (held-out pass@1 before and after RL, per domain, timings) and its
console table (also `tempering report`)."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from tempering import config_history
from tempering.eval.intervals import format_gain, pass_intervals
from tempering.eval.monitor import alerts_of
from tempering.tracking import read_metrics
from tempering.tracking.plot import plot_run
from tempering.workspace import Workspace, write_json


def write_summary(
    ws: Workspace,
    before: dict,
    after: dict,
    wall_time_s: float,
    benchmarks: dict[str, tuple[dict, dict]] | None = None,
) -> dict[str, Any]:
    """summary.json; `benchmarks`: {task set: (greedy evaluation before RL, after)} of `eval.benchmarks`."""
    rows = read_metrics(ws.run_dir / "metrics.jsonl")
    sft_done = ws.run_dir / "sft" / "DONE.json"
    rl_s = sum((r.get("timing_s/step") or 0) + (r.get("timing_s/checkpoint") or 0) for r in rows)
    summary = {
        "heldout_pass@1_before": before["sampled"]["overall"]["pass@1"],
        "heldout_pass@1_after": after["sampled"]["overall"]["pass@1"],
        "heldout_greedy_pass@1_before": before["greedy"]["overall"]["pass@1"],
        "heldout_greedy_pass@1_after": after["greedy"]["overall"]["pass@1"],
        "heldout_tasks": before["sampled"]["num_tasks"],
        **(
            {
                "heldout_first_turn_pass@1_before": before["sampled"]["overall"]["first_turn_pass@1"],
                "heldout_first_turn_pass@1_after": after["sampled"]["overall"]["first_turn_pass@1"],
            }
            if "first_turn_pass@1" in before["sampled"]["overall"]
            else {}
        ),
        "heldout_samples_per_task": before["sampled"]["samples"],
        "temperature": before["sampled"]["temperature"],
        "per_domain_before": {d: v["pass@1"] for d, v in before["sampled"]["per_domain"].items()},
        "per_domain_after": {d: v["pass@1"] for d, v in after["sampled"]["per_domain"].items()},
        **({"sft_steps": json.loads(sft_done.read_text())["steps"]} if sft_done.is_file() else {}),
        "rl_steps": len(rows),
        "rl_step_evaluated": after.get("evaluated", {}).get("step"),
        "rl_steps_planned": ws.cfg.train.steps,
        "wall_time_s": wall_time_s,
        "wall_time_split_s": {
            "sft": json.loads(sft_done.read_text())["wall_time_s"] if sft_done.is_file() else 0.0,
            "eval_before": before["wall_time_s"],
            "rl": rl_s,
            "eval_after": after["wall_time_s"],
        },
    }
    intervals = heldout_intervals(before, after, {t.id: t.domain for t in ws.heldout_tasks})
    if intervals:
        summary["intervals"] = intervals
    if benchmarks:
        summary["benchmarks"] = {name: benchmark_summary(b, a) for name, (b, a) in benchmarks.items()}
        summary["wall_time_split_s"]["benchmarks"] = sum(
            b["wall_time_s"] + a["wall_time_s"] for b, a in benchmarks.values()
        )
    if ws.cfg.data.mixture and ws.cfg.eval.every:
        summary["monitor"] = monitor_summary(rows)
    history = config_history.read_history(ws.run_dir)
    if history:
        summary["config_changes"] = history
    write_json(ws.run_dir / "summary.json", summary)
    val_before = {
        "val/pass@1": summary["heldout_pass@1_before"],
        "val/greedy_pass@1": summary["heldout_greedy_pass@1_before"],
    }
    val_after = {
        "val/pass@1": summary["heldout_pass@1_after"],
        "val/greedy_pass@1": summary["heldout_greedy_pass@1_after"],
    }
    plot_run(
        rows, ws.run_dir / "plot.png", before=val_before, after=val_after, temperature=ws.cfg.eval.temperature
    )
    return summary


def monitor_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The domain monitor's alerts over the run and the mixture weights it left (`eval/monitor.py`)."""
    last = next((r for r in reversed(rows) if "monitor/alerts" in r), {})
    weights = {
        k.split("/")[1]: v for k, v in last.items() if k.startswith("monitor/") and k.endswith("/weight")
    }
    return {
        "validations": sum("monitor/alerts" in r for r in rows),
        "alerts": alerts_of(rows),
        "weights": weights,
    }


def heldout_intervals(before: dict, after: dict, domains: dict[str, str]) -> dict[str, Any]:
    """95% bootstrap intervals (over problems) of sampled and greedy pass@1 before and after RL and of the
    paired gain, overall and per domain; {} when an evaluation has no per-task results (an older run's)."""
    out = {}
    for kind in ("sampled", "greedy"):
        b, a = before[kind], after[kind]
        if b.get("per_task") and a.get("per_task"):
            out[kind] = pass_intervals(
                {t: c / b["samples"] for t, c in b["per_task"].items()},
                {t: c / a["samples"] for t, c in a["per_task"].items()},
                domains,
            )
    return out


def benchmark_summary(before: dict, after: dict) -> dict[str, Any]:
    """Greedy pass@1 of a named task set before and after RL, with 95% intervals and the paired gain."""
    b, a = before["greedy"], after["greedy"]
    ids = {t: "all" for t in b["per_task"]}
    return {
        "tasks": b["num_tasks"],
        "greedy_pass@1_before": b["overall"]["pass@1"],
        "greedy_pass@1_after": a["overall"]["pass@1"],
        "intervals": pass_intervals(b["per_task"], a["per_task"], ids)["all"],
    }


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title=f"held-out pass@1 ({summary['heldout_tasks']} tasks, T={summary['temperature']})")
    table.add_column("domain")
    table.add_column("after SFT", justify="right")
    table.add_column("after RL", justify="right")
    intervals = summary.get("intervals", {})
    if intervals:
        table.add_column("gain [95% CI]", justify="right")

    def gain(kind: str, domain: str) -> list[str]:
        g = intervals.get(kind, {}).get(domain, {}).get("gain")
        return [format_gain(g)] if intervals else []

    for domain, value in summary["per_domain_before"].items():
        table.add_row(
            domain, f"{value:.1%}", f"{summary['per_domain_after'][domain]:.1%}", *gain("sampled", domain)
        )
    table.add_row(
        "[bold]all (sampled)",
        f"{summary['heldout_pass@1_before']:.1%}",
        f"{summary['heldout_pass@1_after']:.1%}",
        *gain("sampled", "all"),
    )
    table.add_row(
        "[bold]all (greedy)",
        f"{summary['heldout_greedy_pass@1_before']:.1%}",
        f"{summary['heldout_greedy_pass@1_after']:.1%}",
        *gain("greedy", "all"),
    )
    for name, b in summary.get("benchmarks", {}).items():
        table.add_row(
            f"[bold]{name} (greedy, {b['tasks']})",
            f"{b['greedy_pass@1_before']:.1%}",
            f"{b['greedy_pass@1_after']:.1%}",
            *([format_gain(b["intervals"]["gain"])] if intervals else []),
        )
    console.print(table)
    monitor = summary.get("monitor")
    if monitor:
        console.print(
            f"domain monitor: {len(monitor['alerts'])} alert(s) over {monitor['validations']} validations"
        )
        for a in monitor["alerts"]:
            note = " (training reward held: check the reward)" if a.get("suspect") else ""
            console.print(
                f"  step {a['step']}: {a['domain']} fell to {a['pass@1']:.1%}, weight {a['weight']:g}{note}"
            )
    console.print(f"wall time {summary['wall_time_s']:.0f} s")
    evaluated, planned = summary.get("rl_step_evaluated"), summary.get("rl_steps_planned")
    if evaluated is not None and planned is not None and evaluated < planned:
        console.print(
            f"RL stopped at step {evaluated} of {planned} (train.max_time_s); run the same command "
            "again to continue (the evaluation after RL is then redone)"
        )
