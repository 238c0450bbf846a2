"""The prepared GPU check (`make gpu-check`): everything that needs CUDA, in at most ten minutes, one summary.

    .venv/bin/python bench/gpu_check.py [--budget-s 600]

Without a CUDA device it says so in one line and exits 0 (nothing here can run). With one, in turn, each
with its share of the budget:
1. `tests/test_gpu.py` (marker `gpu`): sampling, forward passes, the update and a kill-and-resume on CUDA;
2. three RL steps of `configs/smollm2-code-gpu.yaml` (SmolLM2 in bf16 on the GPU), their step time;
3. the vLLM engine's tests (`tests/inference/test_vllm.py`, marker `vllm`) where vllm is importable;
4. the sampling throughput bench in bf16 on the GPU (`bench/engine_throughput.py --device cuda`).
Then one summary: each part's result and figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def run(name: str, argv: list[str], timeout: float) -> tuple[bool, str, str]:
    """Run one part; (whether it passed, its status line, its output's tail)."""
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return False, f"{name}: TIMED OUT after {timeout:.0f} s", ""
    seconds = time.perf_counter() - started
    tail = (done.stdout + done.stderr).strip().splitlines()
    status = "ok" if done.returncode == 0 else f"FAILED (rc {done.returncode})"
    return done.returncode == 0, f"{name}: {status} in {seconds:.0f} s", "\n".join(tail[-12:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=600)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check")
        return 0
    deadline = time.perf_counter() + args.budget_s
    python = sys.executable
    lines = [f"gpu-check on {torch.cuda.get_device_name(0)} (torch {torch.__version__})"]
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        parts = [
            (
                "tests/test_gpu.py",
                [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                0.3,
            ),
            (
                "smollm2-code-gpu, 3 RL steps",
                [
                    python,
                    "-m",
                    "tempering.cli",
                    "train",
                    "configs/smollm2-code-gpu.yaml",
                    f"run.dir={run_dir}",
                    "train.steps=3",
                    "eval.every=0",
                    "checkpoint.every=3",
                    "data.num_heldout=16",
                    "eval.samples=1",
                ],
                0.3,
            ),
        ]
        if importlib.util.find_spec("vllm") is not None:
            parts.append(
                (
                    "vLLM engine tests on CUDA",
                    [
                        python,
                        "-m",
                        "pytest",
                        "-q",
                        "-p",
                        "no:cacheprovider",
                        "-m",
                        "vllm",
                        "tests/inference/test_vllm.py",
                    ],
                    0.2,
                )
            )
        parts.append(
            (
                "throughput bench, bf16",
                [
                    python,
                    "bench/engine_throughput.py",
                    "--device",
                    "cuda",
                    "--precision",
                    "bf16",
                    "--prompts",
                    "4",
                    "8",
                ],
                1.0,
            )
        )
        for name, argv, share in parts:
            left = deadline - time.perf_counter()
            ok, status, tail = run(name, argv, min(left, share * args.budget_s) if share < 1 else left)
            failed |= not ok
            lines += [status, *("    " + line for line in tail.splitlines())]
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            times = [r.get("timing_s/step") for r in rows if r.get("timing_s/step")]
            lines.append(f"RL step times on the GPU: {', '.join(f'{t:.1f} s' for t in times)}")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
