"""Rollout workers on Ray (`distributed.backend: ray`, the `tempering[ray]` extra).

Each `RolloutWorker` actor holds a `RolloutSource` (engine, environments with its own sandbox, reward,
collate) over its own copy of the model, and runs whole shards. Weights travel once per version through
the object store (`weights.to_numpy`: the trained tensors only); every shard carries a reference to the
weights of its version, and a worker loads them when it first meets that version - so a restarted worker
needs no special path. After each load the worker computes the canary probe and the driver checks it
(`canary.check`) before any of that worker's samples of that version are used.

A worker that dies (its process killed, its node gone) is restarted by Ray; the shards it held are re-sent
unchanged (same seeds, same weights), and since a shard's result depends on nothing else, the result is
the same: no sample is lost or counted twice, by construction. Results are keyed by (step, round, shard).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from tempering.config import RunConfig
from tempering.distributed import canary
from tempering.distributed.schedule import ShardSpec
from tempering.distributed.weights import fingerprints, load_numpy, to_numpy
from tempering.rollout.episodes import Rollout, merge_rollouts

DIED = (RayActorError, ActorUnavailableError)


def start_ray(address: str | None, num_cpus: int | None) -> bool:
    """Join the cluster at `address`, or start a local one bound to loopback; True if this call started it."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
    else:  # a local cluster on 127.0.0.1 only (Ray binds the machine's address unless this is 0)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    return True


@ray.remote(max_restarts=-1, max_task_retries=0)
class RolloutWorker:
    def __init__(self, cfg_yaml: str, init: list, load: Callable | None = None):
        import yaml

        from tempering.distributed.source import RolloutSource
        from tempering.workspace import make_sandbox

        cfg = RunConfig.model_validate(yaml.safe_load(cfg_yaml))
        torch.set_num_threads(cfg.run.threads)  # Ray sets OMP threads from num_cpus; same floats need the same
        self.model, tokenizer = ray.get(init[0])
        self.sandbox = make_sandbox(cfg)
        self.source = RolloutSource(cfg, self.model, tokenizer, self.sandbox, version=-1)
        self.load, self.loaded = load or load_numpy, None

    def run(self, spec: ShardSpec, weights: list, probe: canary.Probe | None):
        """The shard's rollout, and - when this call loaded a new version and a probe came - the canary's
        log-probs and the fingerprints of the loaded tensors."""
        check = None
        if self.loaded != spec.version:
            self.load(self.model, ray.get(weights[0]))
            self.source.engine.load_weights(self.model.state_dict(), version=spec.version)
            self.loaded = spec.version
            if probe is not None:
                check = probe.logprobs(self.source.engine), fingerprints(self.model)
        return self.source.run(spec), check

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.sandbox.close()


class RayPool:
    load: Callable | None = None
    """How workers load published arrays into their model (None: `weights.load_numpy`); tests sabotage it."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, tokenizer, probe: canary.Probe, *, reference,
                 log=print):
        """`reference`: the driver's own engine over the trainer's policy (the canary's expected values)."""
        d, ro = cfg.distributed, cfg.rollout
        self.cfg, self.probe, self.reference, self.log = cfg, probe, reference, log
        self.started = start_ray(d.address, d.num_cpus)
        self.init = ray.put((model, tokenizer))
        self.options = {"num_cpus": ro.worker_cpus}
        self.args = (cfg.to_yaml(), [self.init], self.load)
        self.workers = [self._new_worker() for _ in range(ro.workers)]
        self.refs: dict[int, ray.ObjectRef] = {}
        self.expected: dict[int, tuple[torch.Tensor, dict[str, float]]] = {}
        self.last_checked: dict[int, tuple[int, torch.Tensor]] = {}
        self.step_metrics: dict[str, float] = {}

    def _new_worker(self):
        return RolloutWorker.options(**self.options).remote(*self.args)

    # ------------------------------------------------------------------------------------- weights

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self.reference.load_weights(model.state_dict(), version=version)
        self.refs[version] = ray.put(to_numpy(model))
        d = self.cfg.distributed
        if d.canary_every and version % d.canary_every == 0:
            self.expected[version] = self.probe.logprobs(self.reference), fingerprints(model)
        k = self.cfg.rollout.max_staleness
        for old in [v for v in self.refs if v < version - k]:
            del self.refs[old]  # no shard of an older version will be sent again
        for old in [v for v in self.expected if v < version - k - 1]:
            del self.expected[old]  # one more kept: the movement check compares with it

    # -------------------------------------------------------------------------------------- shards

    def submit(self, specs: list[ShardSpec]) -> list[list]:
        return [self._send(spec, spec.shard % len(self.workers), attempts=0) for spec in specs]

    def _send(self, spec: ShardSpec, worker: int, attempts: int) -> list:
        probe = self.probe if spec.version in self.expected else None
        future = self.workers[worker].run.remote(spec, [self.refs[spec.version]], probe)
        return [spec, worker, future, attempts]

    def gather(self, ticket: list[list]) -> Rollout:
        parts = []
        for entry in ticket:
            while True:
                spec, worker, future, attempts = entry
                try:
                    rollout, check = ray.get(future)
                    break
                except DIED as e:
                    if attempts >= self.cfg.distributed.max_retries:
                        raise RuntimeError(f"shard {spec.key} failed {attempts + 1} times; last: {e}") from e
                    self._add("dist/shard_retries", 1)
                    self.log(f"rollout worker {worker} died during shard {spec.key}: re-sent")
                    self.last_checked.pop(worker, None)
                    entry[:] = self._send(spec, (worker + 1) % len(self.workers), attempts + 1)
            if check is not None:
                self._check(worker, spec.version, *check)
            parts.append(rollout)
        return merge_rollouts(parts)

    def _check(self, worker: int, version: int, theirs: torch.Tensor, prints: dict[str, float]) -> None:
        mine, my_prints = self.expected[version]
        last = self.last_checked.get(worker)  # (version, the worker's probe then)
        before = last is not None and last[0] in self.expected
        diff = canary.check(f"rollout worker {worker}", version, mine, theirs, self.cfg.distributed.canary_tol,
                            mine_before=self.expected[last[0]][0] if before else None,
                            theirs_before=last[1] if before else None, my_prints=my_prints, their_prints=prints)
        self.last_checked[worker] = version, theirs
        self.step_metrics["sync/canary_max_abs_diff"] = max(self.step_metrics.get("sync/canary_max_abs_diff", 0.0),
                                                            diff)

    def metrics(self) -> dict[str, float]:
        """This step's pool figures (and reset them)."""
        out = {"dist/workers": float(len(self.workers)), "dist/shard_retries": 0.0, **self.step_metrics}
        self.step_metrics = {}
        return out

    def _add(self, key: str, value: float) -> None:
        self.step_metrics[key] = self.step_metrics.get(key, 0.0) + value

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    def close(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to close
                pass
            ray.kill(w)
        self.workers = []
        if self.started:
            ray.shutdown()
