"""Single-turn code rollouts: sample `group_size` completions per task, execute each against its tests."""

from __future__ import annotations

import torch

from tempering.envs.code import split_examples, with_examples
from tempering.rollout.generate import Generation, encode_prompt, generate
from tempering.sandbox import Sandbox
from tempering.types import Task, Trajectory


def execute(trajectories: list[Trajectory], sandbox: Sandbox, needs: set[str] = frozenset(),
            reference_cpu: dict[str, float] | None = None) -> None:
    """Fill `exec_result` of every trajectory (identical programs for the same task run once), plus what
    the reward needs: `examples` (runs on the prompt's visible examples), `lint` (linter findings),
    `reference` (the reference solution's CPU time, cached per task in `reference_cpu`)."""
    unique: dict[tuple[str, str], list[Trajectory]] = {}
    for traj in trajectories:
        unique.setdefault((traj.task.id, traj.program), []).append(traj)
    groups = list(unique.values())
    jobs = []
    for g in groups:
        # The visible examples ride along as extra tests of the same execution: no extra cost.
        task = with_examples(g[0].task) if "examples" in needs else g[0].task
        jobs.append((task, g[0].program))
    results = sandbox.run_tests_batch(jobs)
    for group, result in zip(groups, results):
        hidden, examples = split_examples(result, len(group[0].task.tests))
        for traj in group:
            traj.exec_result, traj.example_result = hidden, examples
    if "lint" in needs:
        findings = lint_findings([g[0].program if g[0].task.language == "python" else None for g in groups])
        for group, n in zip(groups, findings):
            for traj in group:
                traj.lint_findings = n
    if "reference" in needs:
        cache = reference_cpu if reference_cpu is not None else {}
        missing = {t.task.id: t.task for t in trajectories if t.task.id not in cache and t.task.reference_solution}
        if missing:
            ref_results = sandbox.run_tests_batch([(task, task.reference_solution) for task in missing.values()])
            for task_id, r in zip(missing, ref_results):
                cache[task_id] = r.cpu_time_s if r.all_passed else None
        for traj in trajectories:
            traj.reference_cpu_s = cache.get(traj.task.id)


def lint_findings(codes: list[str | None]) -> list[int | None]:
    """Findings of ruff (pyflakes F, pycodestyle E/W, bugbear B) per code string; None for code that does
    not parse or is not Python. One ruff process for the whole batch; the code is only read, never run."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    out: list[int | None] = [None] * len(codes)
    with tempfile.TemporaryDirectory(prefix="tempering-lint-") as tmp:
        paths = {}
        for i, code in enumerate(codes):
            if code is not None:
                path = Path(tmp) / f"c{i}.py"
                path.write_text(code)
                paths[str(path)] = i
        if not paths:
            return out
        ruff = Path(sys.executable).with_name("ruff")
        proc = subprocess.run([str(ruff) if ruff.exists() else "ruff", "check", "--isolated", "--no-cache",
                               "--select", "E,F,W,B", "--ignore", "E501,W292", "--output-format", "json", tmp],
                              capture_output=True, text=True, timeout=120)
        counts = {i: 0 for i in paths.values()}
        syntax = set()
        for item in json.loads(proc.stdout or "[]"):
            i = paths.get(item["filename"])
            if i is None:
                continue
            if item.get("code") in (None, "invalid-syntax") or "SyntaxError" in item.get("message", ""):
                syntax.add(i)
            counts[i] += 1
        for i, n in counts.items():
            out[i] = None if i in syntax else n
    return out


def sample(
    model,
    tokenizer,
    tasks: list[Task],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[list[Trajectory], Generation]:
    """`group_size` completions per task (consecutive rows), not yet executed."""
    prompts = [encode_prompt(tokenizer, task.prompt) for task in tasks for _ in range(group_size)]
    gen = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, greedy=greedy, generator=generator)
    lengths = gen.response_mask.sum(1).long().tolist()
    trajectories = [
        Trajectory(task=tasks[i // group_size], group_id=i // group_size, completion=text, truncated=bool(trunc),
                   response_tokens=n)
        for i, (text, trunc, n) in enumerate(zip(gen.texts, gen.truncated, lengths))
    ]
    return trajectories, gen


def rollout(model, tokenizer, tasks: list[Task], sandbox: Sandbox, **sampling) -> tuple[list[Trajectory], Generation]:
    """Sample and execute: the trajectories carry their ExecResult."""
    trajectories, gen = sample(model, tokenizer, tasks, **sampling)
    execute(trajectories, sandbox)
    return trajectories, gen
