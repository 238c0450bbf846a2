"""Samples per second of the default recipe's RL steps: local, Ray synchronous, Ray asynchronous (k=1) with
1 and 2 rollout workers and with 1 and 2 data-parallel trainers - with a model of the throughput built from
the measured phases.

    .venv/bin/python bench/distributed_throughput.py [--steps 10] [--rounds 1] [--sft-steps 200]
    .venv/bin/python bench/distributed_throughput.py --sync-cost     # weight sync of SmolLM2 (full and LoRA)

One SFT model is trained once (shortened), then each arm runs `--steps` RL steps of tiny-code from it, arms
alternated over `--rounds`. Steps 1-2 are left out (warm-up; at k=1 both are sampled by version 0). Printed
per arm: samples/s = P x G / mean step time, the mean phases, and the model's prediction:

    C = collect (gen + reward) on one worker; U = U0 + U1, the trainer: U0 on rank 0 only (ref, values,
    recompute, adv), U1 split over M data-parallel trainers (critic, update); W = publish (sync);
    D = dispatch and gather overhead (ray sync: step - C - U - W); A = one step's all-reduces at M = 2
    (a gloo micro-benchmark of the trained parameters, times the optimizer steps of a step).
    Cores are shared equally by the processes that are busy at a time, each using at most one
    (processor sharing, PS(jobs) = when the last job ends); rank r's job is U0 [r = 0] + U1 / M + A [M > 1]
    + W [r = 0]; N workers each collect C / N.
    T_local = C + U + W;  T_sync(N, M) = PS(workers) + PS(trainer ranks) + D
    T_async(N, M) = PS(workers and trainer ranks together) + D

C, U0, U1, W and D come from the Ray synchronous arm with one worker and one trainer; N workers split a
step's shards evenly. Threads: the Ray arms give trainers and workers one thread each (`run.threads=1`) so
that on 2 cores an asynchronous worker and the trainer run side by side; `local-1t` is the local backend at
the same threads.
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
    "ray-k1-2w": [
        "run.threads=1",
        "distributed.backend=ray",
        "rollout.workers=2",
        "rollout.max_staleness=1",
        "rollout.shards=2",
        "rollout.worker_cpus=0.5",
    ],
    "ray-sync-1w-2t": [
        "run.threads=1",
        "distributed.backend=ray",
        "rollout.workers=1",
        "distributed.trainers=2",
    ],
    "ray-k1-1w-2t": [
        "run.threads=1",
        "distributed.backend=ray",
        "rollout.workers=1",
        "rollout.max_staleness=1",
        "distributed.trainers=2",
        "rollout.worker_cpus=0.5",
        "distributed.trainer_cpus=0.5",
    ],
}
RANK0 = ("ref", "values", "recompute", "adv")  # the trainer's phases that stay on rank 0
SPLIT = ("critic", "update")  # the phases data-parallel trainers share
CORES = 2


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
    lora = add_adapters(
        load_model(directory), directory, r=16, alpha=32, dropout=0.0, target_modules="all-linear", seed=0
    )
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
        print(
            f"SmolLM2 {name}: {size:.1f} MB; publish {statistics.median(puts):.3f} s, "
            f"worker load {statistics.median(loads):.3f} s (median of {repeats})"
        )
        ray.kill(holder)
    ray.shutdown()


def shared(jobs: list[float], cores: int = CORES) -> float:
    """When the last of `jobs` (seconds of one core's work each) ends, if the cores are shared equally by the
    jobs still running, each using at most one core (processor sharing)."""
    t, left = 0.0, sorted(jobs)
    while left:
        speed = min(1.0, cores / len(left))
        t += left[0] / speed
        left = [x - left[0] for x in left[1:]]
    return t


def allreduce_seconds(model_dir: Path, repeats: int = 20) -> float:
    """Median seconds of one all-reduce of the trained parameters between two gloo ranks on loopback (threads of
    this process, one torch thread each)."""
    import statistics
    import threading
    import time

    import torch

    from tempering.distributed.weights import trained
    from tempering.models.loading import load_model
    from tempering.training.data_parallel import DataParallel, Rendezvous

    numel = sum(p.numel() for p in trained(load_model(model_dir)).values())
    torch.set_num_threads(1)
    times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = Rendezvous(2, path=str(Path(tmp) / "store"))

        def rank(r: int) -> None:
            dp, buffer = DataParallel(r, rendezvous), torch.ones(numel)
            for _ in range(repeats):
                start = time.perf_counter()
                dp.allreduce_([buffer])
                if r == 0:
                    times.append(time.perf_counter() - start)
            dp.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return statistics.median(times)


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
        one_allreduce = allreduce_seconds(sft_dir / "sft" / "model")
        for r in range(args.rounds):
            for arm, overrides in ARMS.items():
                run_dir = work / f"{arm}-{r}"
                tempering(ROOT, "train", recipe, f"run.dir={run_dir}", *common, *start, *overrides)
                times[arm].append(phases(run_dir))
    mean = {
        arm: {k: sum(p.get(k, 0.0) for p in ps) / len(ps) for k in set().union(*ps)}
        for arm, ps in times.items()
    }
    with open(ROOT / recipe) as f:
        import yaml

        recipe_cfg = yaml.safe_load(f)
    ro, algo = recipe_cfg["rollout"], recipe_cfg["algo"]
    samples = ro["prompts_per_step"] * ro["group_size"]
    ref = mean["ray-sync-1w"]
    c = ref.get("gen", 0.0) + ref.get("reward", 0.0)
    u0, u1 = sum(ref.get(k, 0.0) for k in RANK0), sum(ref.get(k, 0.0) for k in SPLIT)
    w = ref.get("sync", 0.0)
    d = max(0.0, ref["step"] - c - u0 - u1 - w)
    a = one_allreduce * algo.get("ppo_epochs", 1) * algo.get("minibatches", 1)

    def workers(n: int) -> list[float]:
        return [c / n] * n

    def ranks(m: int) -> list[float]:
        split = u1 / m + (a if m > 1 else 0.0)
        return [u0 + split + w] + [split] * (m - 1)

    model = {
        "local-2t": None,
        "local-1t": c + u0 + u1 + w,
        "ray-sync-1w": shared(workers(1)) + shared(ranks(1)) + d,
        "ray-k1-1w": shared(workers(1) + ranks(1)) + d,
        "ray-k1-2w": shared(workers(2) + ranks(1)) + d,
        "ray-sync-1w-2t": shared(workers(1)) + shared(ranks(2)) + d,
        "ray-k1-1w-2t": shared(workers(1) + ranks(2)) + d,
    }
    print(f"tiny-code, {samples} samples per step, steps 3-{args.steps}, {args.rounds} round(s)")
    print(
        f"model inputs (ray-sync-1w): C {c:.3f} s  U0 {u0:.3f} s  U1 {u1:.3f} s  W {w:.3f} s  D {d:.3f} s  "
        f"A {a:.4f} s ({one_allreduce * 1e3:.2f} ms an all-reduce)"
    )
    print(
        f"{'arm':<16}{'samples/s':>10}{'step s':>8}{'model s':>9}{'err':>7}{'gen':>7}{'reward':>8}{'wait':>7}"
        f"{'update':>8}{'allred':>8}{'sync':>7}"
    )
    for arm, m in mean.items():
        pred = model[arm]
        err = f"{(m['step'] - pred) / pred:+.0%}" if pred else "-"
        print(
            f"{arm:<16}{samples / m['step']:>10.1f}{m['step']:>8.3f}{(f'{pred:.3f}' if pred else '-'):>9}{err:>7}"
            f"{m.get('gen', 0):>7.3f}{m.get('reward', 0):>8.3f}{m.get('wait', 0):>7.3f}{m.get('update', 0):>8.3f}"
            f"{m.get('allreduce', 0):>8.3f}{m.get('sync', 0):>7.3f}"
        )
    base = mean["ray-sync-1w"]["step"]
    print(
        f"ray sync / local-1t step time: {base / mean['local-1t']['step']:.3f}; async speed-up over ray sync: "
        f"1 worker {base / mean['ray-k1-1w']['step']:.2f}x, 2 workers {base / mean['ray-k1-2w']['step']:.2f}x; "
        f"2 trainers: sync {base / mean['ray-sync-1w-2t']['step']:.2f}x, "
        f"async {base / mean['ray-k1-1w-2t']['step']:.2f}x; update phase 1 -> 2 trainers (sync): "
        f"{ref['update'] / mean['ray-sync-1w-2t']['update']:.2f}x"
    )


if __name__ == "__main__":
    main()
