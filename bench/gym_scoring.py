"""What scoring reasoning-gym answers in the sandbox costs, against calling the verifiers in-process.

    .venv/bin/python bench/gym_scoring.py [--answers 200] [--workers 1 2]

Before (the old way, unsafe): each dataset's `score_answer` called in this process on a cached dataset
object. After: `score_gym_answers` on a verifier pool (one forked sandbox execution per answer, batched
across the pool's workers). The answers are, per task, the reference, a wrong one and two near misses
(partial credit for some datasets); both ways must give the same scores. Prints the pool's start-up time
(paid once per run) and the time per answer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import reasoning_gym

from tempering.envs.answer import answers_match
from tempering.envs.gym import HOST_CHECKED, gym_datasets, gym_tasks, score_gym_answers, verifier_pool
from tempering.sandbox import LocalSandbox

MIX = [
    "basic_arithmetic",
    "arc_1d",
    "arc_agi",
    "game_of_life_halting",
    "string_insertion",
    "spiral_matrix",
    "binary_matrix",
    "n_queens",
    "countdown",
    "puzzle24",
    "simple_integration",
    "polynomial_multiplication",
    "spell_backward",
    "word_sorting",
    "letter_counting",
    "chain_sum",
    "rotate_matrix",
    "codeio",
    "propositional_logic",
    "sudoku",
]


def answers(n: int) -> list:
    names = [d for d in MIX if d in gym_datasets()]
    per = max(1, -(-n // (4 * len(names))))
    train, _ = gym_tasks(names, per, 0, seed=5, max_prompt_chars=100_000)
    items = []
    for task in train:
        ref = str(task.answer)
        items += [(task, ref), (task, "zzz"), (task, ref[:-1]), (task, ref + " x")]
    return items[:n]


def in_process(items: list) -> list[float]:
    """The old scoring path: the verifier called here (cached dataset objects, as before)."""
    cache: dict = {}
    scores = []
    for task, answer in items:
        name, entry = task.metadata["dataset"], dict(task.metadata["entry"])
        meta = entry.get("metadata", {})
        if isinstance(meta.get("output"), list) and meta.get("source_dataset") in ("arc_agi", "rearc"):
            entry["metadata"] = {**meta, "output": tuple(map(tuple, meta["output"]))}
        if name in HOST_CHECKED:
            scores.append(float(answers_match(answer, entry["answer"])))
            continue
        key = (name, json.dumps(task.metadata.get("config") or {}, sort_keys=True))
        if key not in cache:
            cache[key] = reasoning_gym.create_dataset(name, seed=0, size=1, **json.loads(key[1]))
        try:
            scores.append(min(max(float(cache[key].score_answer(answer, entry) or 0.0), 0.0), 1.0))
        except Exception:  # noqa: BLE001
            scores.append(0.0)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--answers", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--isolation", default="auto")
    args = parser.parse_args()

    items = answers(args.answers)
    print(
        f"# {platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"{len(items)} answers over {len({t.domain for t, _ in items})} datasets"
    )
    in_process(items[:8])  # warm the cache: the old path paid dataset creation once per run too
    start = time.perf_counter()
    reference = in_process(items)
    before = (time.perf_counter() - start) / len(items)
    print(f"{'way':<34}{'start-up s':>12}{'ms/answer':>12}{'answers/s':>12}")
    print(f"{'in-process (before, unsafe)':<34}{'-':>12}{before * 1e3:>12.3f}{1 / before:>12.0f}")
    for workers in args.workers:
        start = time.perf_counter()
        pool: LocalSandbox = verifier_pool(args.isolation, workers)
        startup = time.perf_counter() - start
        score_gym_answers(items[:workers], pool)
        start = time.perf_counter()
        scores = score_gym_answers(items, pool)
        after = (time.perf_counter() - start) / len(items)
        label = f"sandboxed, {workers} worker(s), {pool.backend}"
        print(f"{label:<34}{startup:>12.1f}{after * 1e3:>12.3f}{1 / after:>12.0f}")
        differ = [
            (t.domain, a[:30], r, s) for (t, a), r, s in zip(items, reference, scores) if abs(r - s) > 1e-9
        ]
        if differ:
            print(f"  {len(differ)} scores differ from in-process: {differ[:5]}")
    partial = sum(0 < s < 1 for s in reference)
    print(
        f"# {sum(s == 1 for s in reference)} full, {partial} partial, "
        f"{sum(s == 0 for s in reference)} zero scores; same in both ways unless listed above"
    )


if __name__ == "__main__":
    main()
