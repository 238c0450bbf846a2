"""`tempering report RUN_DIR`: one self-contained HTML page of a run (figures inlined as PNG, no scripts,
no network): the summary, held-out pass@1 per domain before and after RL with 95% intervals (bars), the
validation pass@1 over the steps per domain, reward and its components, response length, KL, entropy,
per-phase step time, and a table of sample completions with their rewards. Per-step curves are drawn
smoothed (an exponential moving average, debiased as TensorBoard does) over the raw values, faint. Every
metric of a panel is drawn: a panel with more than `LINES_PER_FIGURE` names is split over several figures
(a run over many domains has dozens of reward components), the overall ones first."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from tempering.errors import TemperingError
from tempering.eval.intervals import format_gain
from tempering.tracking import read_metrics

SUMMARY_KEYS = (
    "heldout_pass@1_before",
    "heldout_pass@1_after",
    "heldout_greedy_pass@1_before",
    "heldout_greedy_pass@1_after",
    "heldout_tasks",
    "temperature",
    "per_domain_before",
    "per_domain_after",
    "wall_time_s",
)
"""What a finished run's summary.json holds (`summary.write_summary`)."""

PANELS: list[tuple[str, str]] = [
    ("reward", "reward/"),
    ("pass rate", "train/"),
    ("response length", "response_length/"),
    ("KL", "kl"),
    ("entropy", "actor/entropy"),
    ("step time (s)", "timing_s/"),
]
"""(title, metric prefix or substring): each panel plots the per-step metrics whose name matches."""
SKIP = ("reward/hacking/", "/std", "/max", "/min")
LINES_PER_FIGURE = 10
STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}
pre{white-space:pre-wrap;margin:0;max-width:720px;font-size:12px}.grid img{max-width:48%;margin:4px}"""


def _matches(name: str, pattern: str) -> bool:
    if any(s in name for s in SKIP):
        return False
    return name.startswith(pattern) if pattern.endswith("/") else pattern in name


def panel_names(rows: list[dict[str, Any]], pattern: str) -> list[list[str]]:
    """The metric names a panel draws, in figures of at most LINES_PER_FIGURE: the fewest path parts
    first (`reward/mean` before `reward/lists/mean`), then by name."""
    names = sorted(
        {k for r in rows for k, v in r.items() if isinstance(v, int | float) and _matches(k, pattern)},
        key=lambda k: (k.count("/"), k),
    )
    return [names[i : i + LINES_PER_FIGURE] for i in range(0, len(names), LINES_PER_FIGURE)]


def _figures(title: str, rows: list[dict[str, Any]], pattern: str) -> list[tuple[str, str]]:
    """(title, PNG as base64) of each figure of a panel."""
    groups = panel_names(rows, pattern)
    titles = (
        [title] if len(groups) == 1 else [f"{title} ({i + 1} of {len(groups)})" for i in range(len(groups))]
    )
    return [(t, _figure(t, rows, names)) for t, names in zip(titles, groups)]


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average with weight 2 / (span + 1) on the newest value, debiased (divided by the
    weights' sum, so the first points are not pulled towards 0)."""
    alpha, avg, norm, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        avg, norm = (1 - alpha) * avg + alpha * v, (1 - alpha) * norm + alpha
        out.append(avg / norm)
    return out


def smoothing_span(points: int) -> int:
    """A tenth of the run (at least 1: no smoothing for runs of a few steps)."""
    return max(1, points // 10)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _axes(title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.set_title(title)
    return fig, ax


def _figure(title: str, rows: list[dict[str, Any]], names: list[str]) -> str:
    fig, ax = _axes(title)
    for name in names:
        pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), int | float)]
        steps, values = [p[0] for p in pts], [p[1] for p in pts]
        span = smoothing_span(len(values))
        if span > 1:
            (raw,) = ax.plot(steps, values, lw=0.7, alpha=0.25)
            ax.plot(steps, ema(values, span), lw=1.5, color=raw.get_color(), label=name)
        else:
            ax.plot(steps, values, marker=".", lw=1.2, label=name)
    ax.set_xlabel(
        "RL step"
        + (
            f" (EMA over ~{smoothing_span(len(rows))} steps; raw faint)"
            if smoothing_span(len(rows)) > 1
            else ""
        )
    )
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def validation_figure(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str | None:
    """Held-out pass@1 at each validation (`eval.every`), overall and per domain, from the evaluation before
    RL (step 0) to the one after it (the last step), when the run has them."""
    ends = {
        "val/pass@1": ("heldout_pass@1_before", "heldout_pass@1_after"),
        "val/greedy_pass@1": ("heldout_greedy_pass@1_before", "heldout_greedy_pass@1_after"),
    }
    names = {
        k for r in rows for k in r if k.startswith("val/") and k.endswith("pass@1") and "first_turn" not in k
    }
    if summary:
        names |= {*ends, *(f"val/{d}/pass@1" for d in summary.get("per_domain_before", {}))}
    if not names:
        return None
    names = sorted(names, key=lambda k: (k.count("/"), k))
    last = rows[-1]["step"] if rows else 0
    fig, ax = _axes("held-out pass@1 (validation)")
    for name in names:
        pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), int | float)]
        if name in ends:
            b, a = ends[name]
            before, after = summary.get(b), summary.get(a)
        else:
            domain = name.split("/")[1]
            before = summary.get("per_domain_before", {}).get(domain)
            after = summary.get("per_domain_after", {}).get(domain)
        pts = (
            ([(0, before)] if before is not None else [])
            + pts
            + ([(last, after)] if after is not None else [])
        )
        overall = name.count("/") == 1
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            ms=3,
            lw=2.0 if overall else 1.0,
            alpha=1.0 if overall else 0.7,
            label=name,
        )
    ax.set_xlabel("RL step (0: before RL; last: the evaluation after RL, all held-out tasks)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def bars_figure(summary: dict[str, Any]) -> str | None:
    """Sampled pass@1 per domain before and after RL, with 95% bootstrap intervals over problems."""
    before, after = summary.get("per_domain_before", {}), summary.get("per_domain_after", {})
    if not before:
        return None
    intervals = summary.get("intervals", {}).get("sampled", {})
    labels = [*before, "all"]
    values = {
        "before RL": [*before.values(), summary["heldout_pass@1_before"]],
        "after RL": [*(after.get(d, float("nan")) for d in before), summary["heldout_pass@1_after"]],
    }
    fig, ax = _axes("held-out sampled pass@1 (95% intervals)")
    width = 0.4
    for i, (kind, vals) in enumerate(values.items()):
        key = "before" if i == 0 else "after"
        errors = None
        if intervals:
            low = [max(0.0, v - intervals.get(d, {}).get(key, [v, v])[0]) for d, v in zip(labels, vals)]
            high = [max(0.0, intervals.get(d, {}).get(key, [v, v])[1] - v) for d, v in zip(labels, vals)]
            errors = [low, high]
        ax.bar(
            [x + (i - 0.5) * width for x in range(len(labels))],
            vals,
            width,
            yerr=errors,
            capsize=3,
            label=kind,
        )
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json when the run finished, else {}; one error naming the file when it is unreadable."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text())
    except ValueError as e:
        raise TemperingError(f"'{path}' is not valid JSON ({e})") from None
    return summary if isinstance(summary, dict) and all(k in summary for k in SUMMARY_KEYS) else {}


def _passk_table(summary: dict[str, Any]) -> str:
    before, after = summary.get("per_domain_before", {}), summary.get("per_domain_after", {})
    if not before:
        return "<p>no held-out evaluation recorded</p>"
    intervals = summary.get("intervals", {})

    def gain(kind: str, domain: str) -> str:
        g = intervals.get(kind, {}).get(domain, {}).get("gain")
        return f"<td>{format_gain(g)}</td>" if intervals else ""

    rows = "".join(
        f"<tr><td>{html.escape(d)}</td><td>{before[d]:.1%}</td><td>{after.get(d, float('nan')):.1%}</td>"
        f"{gain('sampled', d)}</tr>"
        for d in before
    )
    totals = [
        ("all (sampled)", "heldout_pass@1_before", "heldout_pass@1_after", "sampled"),
        ("all (greedy)", "heldout_greedy_pass@1_before", "heldout_greedy_pass@1_after", "greedy"),
    ]
    rows += "".join(
        f"<tr><th>{name}</th><th>{summary[b]:.1%}</th><th>{summary[a]:.1%}</th>{gain(kind, 'all')}</tr>"
        for name, b, a, kind in totals
        if b in summary and a in summary
    )
    for name, b in summary.get("benchmarks", {}).items():  # eval.benchmarks, greedy
        gain_cell = f"<td>{format_gain(b['intervals']['gain'])}</td>" if intervals else ""
        rows += (
            f"<tr><th>{html.escape(name)} (greedy, {b['tasks']})</th><th>{b['greedy_pass@1_before']:.1%}</th>"
            f"<th>{b['greedy_pass@1_after']:.1%}</th>{gain_cell}</tr>"
        )
    head = "<th>gain, points [95% CI]</th>" if intervals else ""
    return f"<table><tr><th>domain</th><th>before RL</th><th>after RL</th>{head}</tr>{rows}</table>"


def _samples_table(run_dir: Path, limit: int) -> str:
    files = sorted((run_dir / "samples").glob("step_*.jsonl"))
    if not files:
        return "<p>no samples recorded (tracking.samples_every)</p>"
    samples = read_metrics(files[-1])[:limit]
    body = []
    for s in samples:
        turns = s.get("turns") or [{"action": s.get("completion", "")}]
        actions = "\n\n".join(
            f"[turn {i + 1}] {t.get('action', '')}"
            + (f"\n-> {t['observation']}" if t.get("observation") else "")
            for i, t in enumerate(turns)
        )
        components = ", ".join(f"{k} {v:.2f}" for k, v in (s.get("components") or {}).items())
        body.append(
            f"<tr><td>{html.escape(str(s.get('task_id')))}</td><td>{s.get('reward', 0):.3f}<br>"
            f"<small>{html.escape(components)}</small></td><td><pre>{html.escape(actions)}</pre></td></tr>"
        )
    return (
        f"<p>{files[-1].name}</p><table><tr><th>task</th><th>reward</th><th>completion</th></tr>"
        f"{''.join(body)}</table>"
    )


def _monitor_html(summary: dict[str, Any]) -> str:
    """The domain monitor's alerts (a mixture run with periodic validation), or nothing."""
    monitor = summary.get("monitor")
    if not monitor:
        return ""
    rows = "".join(
        f"<tr><td>{a['step']}</td><td>{html.escape(a['domain'])}</td><td>{a['pass@1']:.1%}</td>"
        f"<td>{a['weight']:g}</td><td>{'yes' if a.get('suspect') else ''}</td></tr>"
        for a in monitor["alerts"]
    )
    head = (
        "<tr><th>step</th><th>domain</th><th>validation pass@1</th><th>mixture weight after</th>"
        "<th>training reward held (suspect)</th></tr>"
    )
    return (
        f"<h2>Domain monitor</h2><p>{len(monitor['alerts'])} alert(s) over {monitor['validations']} "
        f"validations: a domain whose pass@1 fell past its interval, and the weight it got.</p>"
        + (f"<table>{head}{rows}</table>" if rows else "")
    )


def write_report(run_dir: Path, out: Path | None = None, samples: int = 12) -> Path:
    """Write RUN_DIR/report.html (or `out`) from metrics.jsonl, summary.json and the newest samples file."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = read_summary(run_dir)
    held_out = [
        (t, png)
        for t, png in (
            ("held-out pass@1 before and after RL", bars_figure(summary)),
            ("held-out pass@1 (validation)", validation_figure(rows, summary)),
        )
        if png
    ]
    figures = [f for title, pattern in PANELS for f in _figures(title, rows, pattern)]
    images = "".join(f'<img alt="{html.escape(t)}" src="data:image/png;base64,{png}">' for t, png in figures)
    held_out_images = "".join(
        f'<img alt="{html.escape(t)}" src="data:image/png;base64,{png}">' for t, png in held_out
    )
    facts = {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
    facts_html = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}"
        "</td></tr>"
        for k, v in facts.items()
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>tempering run {html.escape(run_dir.name)}"
        f"</title><style>{STYLE}</style></head><body><h1>tempering run: {html.escape(str(run_dir))}</h1>"
        f"<p>{len(rows)} RL steps recorded</p><h2>Held-out pass@1 per domain</h2>{_passk_table(summary)}"
        f"<div class='grid'>{held_out_images}</div>{_monitor_html(summary)}"
        f"<h2>Training curves</h2><div class='grid'>{images or '<p>no RL steps yet</p>'}</div>"
        f"<h2>Sample completions</h2>{_samples_table(run_dir, samples)}"
        f"<h2>Summary</h2><table>{facts_html}</table></body></html>"
    )
    out = out or run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out
