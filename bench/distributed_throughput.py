"""Samples per second of the default recipe's RL steps: local, Ray synchronous, Ray asynchronous (k=1) with
1 and 2 rollout workers - with a model of the throughput built from the measured phases.

    .venv/bin/python bench/distributed_throughput.py [--steps 10] [--rounds 1] [--sft-steps 200]
    .venv/bin/python bench/distributed_throughput.py --sync-cost     # weight sync of SmolLM2 (full and LoRA)

One SFT model is trained once (shortened), then each arm runs `--steps` RL steps of tiny-code from it, arms
alternated over `--rounds`. Steps 1-2 are left out (warm-up; at k=1 both are sampled by version 0). Printed
per arm: samples/s = P x G / mean step time, the mean phases, and the model's prediction:

    C = collect (gen + reward) on one worker, U = trainer (ref, values, recompute, adv, update),
    W = publish (sync), D = dispatch and gather overhead (ray sync: step - C - U - W)
    T_local = C + U + W;  T_sync(N) = C / N + U + W + D;  T_async(N) = max(C / N, U + W) + D

C, U, W and D come from the Ray synchronous arm with one worker; N workers split a step's shards evenly.
Threads: the Ray arms give trainer and workers one thread each (`run.threads=1`) so that on 2 cores an
asynchronous worker and the trainer run side by side; `local-1t` is the local backend at the same threads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phase_times import COMMON, ROOT, tempering  # noqa: E402

ARMS = {
    "local-2t": ["run.threads=2"],
    "local-1t": ["run.threads=1"],
    "ray-sync-1w": ["run.threads=1", "distributed.backend=ray", "rollout.workers=1"],
    "ray-k1-1w": ["run.threads=1", "distributed.backend=ray", "rollout.workers=1", "rollout.max_staleness=1"],
    "ray-k1-2w": ["run.threads=1", "distributed.backend=ray", "rollout.workers=2", "rollout.max_staleness=1",
                  "rollout.shards=2", "rollout.worker_cpus=0.5"],
}
TRAINER = ("ref", "values", "recompute", "adv", "critic", "update")


def phases(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    keys = {k for r in rows for k in r if k.startswith("timing_s/")}
    return {k.split("/", 1)[1]: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}


def sync_cost(repeats: int = 3) -> None:
    """Seconds of one weight sync of SmolLM2-135M-Instruct through a local Ray cluster: `publish`'s part (numpy
    views of the trained tensors, one `ray.put`) and a worker's (get + copy into its parameters), full model
    and LoRA (r=16, all linear layers: the adapters only), the median of `repeats`."""
    import statistics
    import time

    import ray
    import torch

    from tempering.checkpoint import resolve_model
    from tempering.distributed.ray_pool import start_ray
    from tempering.distributed.weights import load_numpy, to_numpy
    from tempering.models.loading import load_model
    from tempering.models.lora import add_adapters

    @ray.remote(num_cpus=1)
    class Holder:
        def __init__(self, model):
            torch.set_num_threads(1)
            self.model = model

        def load(self, arrays: list) -> float:
            start = time.perf_counter()
            load_numpy(self.model, ray.get(arrays[0]))
            return time.perf_counter() - start

    start_ray(None, 2)
    directory = resolve_model("smollm2-135m-instruct")
    full = load_model(directory)
    lora = add_adapters(load_model(directory), directory, r=16, alpha=32, dropout=0.0, target_modules="all-linear",
                        seed=0)
    for name, model in (("full", full), ("LoRA r=16", lora)):
        holder = Holder.remote(model)
        puts, loads = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            ref = ray.put(to_numpy(model))
            puts.append(time.perf_counter() - t)
            loads.append(ray.get(holder.load.remote([ref])))
            del ref
        size = sum(a.nbytes for a in to_numpy(model).values()) / 2**20
        print(f"SmolLM2 {name}: {size:.1f} MB; publish {statistics.median(puts):.3f} s, "
              f"worker load {statistics.median(loads):.3f} s (median of {repeats})")
        ray.kill(holder)
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--sync-cost", action="store_true", help="only the SmolLM2 weight-sync cost")
    args = parser.parse_args()
    if args.sync_cost:
        return sync_cost()
    recipe = "configs/tiny-code.yaml"
    common = [*COMMON, "data.num_train=3000", "data.num_heldout=64", f"train.steps={args.steps}"]
    times: dict[str, list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sft_dir = work / "sft"
        tempering(ROOT, "sft", recipe, f"run.dir={sft_dir}", f"sft.steps={args.sft_steps}", *common)
        start = [f"model.path={sft_dir / 'sft' / 'model'}", "sft.steps=0"]
        for r in range(args.rounds):
            for arm, overrides in ARMS.items():
                run_dir = work / f"{arm}-{r}"
                tempering(ROOT, "train", recipe, f"run.dir={run_dir}", *common, *start, *overrides)
                times[arm].append(phases(run_dir))
    mean = {arm: {k: sum(p.get(k, 0.0) for p in ps) / len(ps) for k in set().union(*ps)} for arm, ps in times.items()}
    with open(ROOT / recipe) as f:
        import yaml

        ro = yaml.safe_load(f)["rollout"]
    samples = ro["prompts_per_step"] * ro["group_size"]
    ref = mean["ray-sync-1w"]
    c = ref.get("gen", 0.0) + ref.get("reward", 0.0)
    u = sum(ref.get(k, 0.0) for k in TRAINER)
    w = ref.get("sync", 0.0)
    d = max(0.0, ref["step"] - c - u - w)
    model = {"local-2t": None, "local-1t": c + u + w, "ray-sync-1w": c + u + w + d,
             "ray-k1-1w": max(c, u + w) + d, "ray-k1-2w": max(c / 2, u + w) + d}
    print(f"tiny-code, {samples} samples per step, steps 3-{args.steps}, {args.rounds} round(s)")
    print(f"model inputs (ray-sync-1w): C {c:.3f} s  U {u:.3f} s  W {w:.3f} s  D {d:.3f} s")
    print(f"{'arm':<13}{'samples/s':>10}{'step s':>8}{'model s':>9}{'err':>7}{'gen':>7}{'reward':>8}{'wait':>7}"
          f"{'update':>8}{'sync':>7}")
    for arm, m in mean.items():
        pred = model[arm]
        err = f"{(m['step'] - pred) / pred:+.0%}" if pred else "-"
        print(f"{arm:<13}{samples / m['step']:>10.1f}{m['step']:>8.3f}{(f'{pred:.3f}' if pred else '-'):>9}{err:>7}"
              f"{m.get('gen', 0):>7.3f}{m.get('reward', 0):>8.3f}{m.get('wait', 0):>7.3f}{m.get('update', 0):>8.3f}"
              f"{m.get('sync', 0):>7.3f}")
    base = mean["ray-sync-1w"]["step"]
    print(f"ray sync / local-1t step time: {base / mean['local-1t']['step']:.3f}; async speed-up over ray sync: "
          f"1 worker {base / mean['ray-k1-1w']['step']:.2f}x, 2 workers {base / mean['ray-k1-2w']['step']:.2f}x")


if __name__ == "__main__":
    main()
