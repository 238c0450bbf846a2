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
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch
from ray._private import ray_constants
from ray._raylet import Config

from tempering.config import RunConfig
from tempering.distributed import canary, reaper
from tempering.distributed.sandbox import DIED, RaySandbox, SandboxActor
from tempering.distributed.schedule import ShardSpec
from tempering.distributed.weights import fingerprints, load_numpy, to_numpy
from tempering.rollout.batch import Rollout, merge_rollouts
from tempering.runtime import configure

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def start_ray(address: str | None, num_cpus: int | None) -> reaper.Watcher | None:
    """Join the cluster at `address`, or start a local one that listens on loopback only and asks every client
    for a token. The local cluster's watcher (`reaper`) when this call started one: `stop_ray` ends both."""
    if ray.is_initialized():
        return None
    if address:
        ray.init(address=address, log_to_driver=False)
        return None
    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is imported (so setting it here alone
    # changed nothing): with it off the node's address is loopback, and the GCS, raylet, workers, agents and
    # metrics bind that address alone. The variable serves the processes Ray starts, the constant this one.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Token authentication whatever the environment says; one random token per driver process, in the
    # environment of the cluster's processes only (nothing written to ~/.ray). This process read the mode when
    # `ray` was imported: Config.initialize reads it again (as Ray itself does when it turns token mode on).
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    Config.initialize("")
    watcher = reaper.Watcher()
    try:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _temp_dir=watcher.root,
        )
    except BaseException:
        watcher.close()
        raise
    if (host := ray.util.get_node_ip_address()) not in LOOPBACK:
        stop_ray(watcher)
        raise RuntimeError(f"the local Ray cluster came up on {host}, not loopback; refusing to use it")
    return watcher


def stop_ray(watcher: reaper.Watcher | None) -> None:
    """Shut down the cluster `start_ray` started (nothing if it joined one), and kill whatever outlived that."""
    if watcher is not None:
        ray.shutdown()
        watcher.close()


@ray.remote(max_restarts=-1, max_task_retries=0)
class RolloutWorker:
    def __init__(
        self, cfg_yaml: str, init: list, load: Callable | None = None, sandboxes: list | None = None
    ):
        import yaml

        from tempering.distributed.source import RolloutSource
        from tempering.workspace import make_sandbox, sandbox_limits

        cfg = RunConfig.model_validate(yaml.safe_load(cfg_yaml))
        configure(cfg.run.threads)  # Ray sets OMP threads from num_cpus; same floats need the same
        self.model, tokenizer = ray.get(init[0])
        self.sandbox = (
            RaySandbox(sandboxes, sandbox_limits(cfg), cfg.distributed.max_retries)
            if sandboxes
            else make_sandbox(cfg)
        )
        self.source = RolloutSource(cfg, self.model, tokenizer, self.sandbox, version=-1)
        self.load, self.loaded = load or load_numpy, None

    def run(self, spec: ShardSpec, weights: list, probe: canary.Probe | None):
        """The shard's rollout; when this call loaded a new version and a probe came, the canary's log-probs and
        the fingerprints of the loaded tensors; and how many sandbox batches were re-sent (a sandbox actor died)."""
        check = None
        if self.loaded != spec.version:
            self.load(self.model, ray.get(weights[0]))
            self.source.engine.load_weights(self.model.state_dict(), version=spec.version)
            self.loaded = spec.version
            if probe is not None:
                check = probe.logprobs(self.source.engine), fingerprints(self.model)
        retried = getattr(self.sandbox, "retries", 0)
        rollout = self.source.run(spec)
        return rollout, check, getattr(self.sandbox, "retries", 0) - retried

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.sandbox.close()


@dataclass(eq=False)
class _Shard:
    """One shard's way through the pool: queued, sent to a worker (`future`), re-queued if that worker died."""

    spec: ShardSpec
    future: ray.ObjectRef | None = None
    worker: int = -1
    attempts: int = 0
    sent: threading.Event = field(default_factory=threading.Event)


class RayPool:
    load: Callable | None = None
    """How workers load published arrays into their model (None: `weights.load_numpy`); tests sabotage it."""

    def __init__(
        self, cfg: RunConfig, model: torch.nn.Module, tokenizer, probe: canary.Probe, *, reference, log=print
    ):
        """`reference`: the driver's own engine over the trainer's policy (the canary's expected values)."""
        d, ro = cfg.distributed, cfg.rollout
        self.cfg, self.probe, self.reference, self.log = cfg, probe, reference, log
        self.min_workers, self.max_workers = ro.min_workers or ro.workers, ro.max_workers or ro.workers
        self.cluster = start_ray(d.address, d.num_cpus)
        self.init = ray.put((model, tokenizer))
        # CPU-less: the executions they run are what uses CPU, and they must never wait for a rollout worker's slot
        self.sandboxes = [
            SandboxActor.options(num_cpus=0).remote(cfg.to_yaml()) for _ in range(d.sandbox_actors)
        ]
        self.args = (cfg.to_yaml(), [self.init], self.load, self.sandboxes)
        self.workers: list = []
        self.busy: list[_Shard | None] = []  # per worker: the shard it runs (one at a time)
        self.starting: list[ray.ObjectRef | None] = []  # per worker: its first answer, until it came
        self.idle_since: list[float] = []
        self.queue: deque[_Shard] = deque()
        self.refs: dict[int, ray.ObjectRef] = {}
        self.expected: dict[int, tuple[torch.Tensor, dict[str, float]]] = {}
        self.last_checked: dict[int, tuple[int, torch.Tensor]] = {}
        self.step_metrics: dict[str, float] = {}
        self.lock, self.wake, self.stop = threading.Lock(), threading.Event(), threading.Event()
        self.failure: BaseException | None = None
        for _ in range(ro.workers):
            self._add_worker()
        # The first step waits for the workers anyway; waiting here, before the dispatcher sends anything, lets
        # a run's first steps - a resumed run's too - find the pool as later ones do (the same dist/backlog).
        if self.starting:
            ray.wait(self.starting, num_returns=len(self.starting), timeout=300)
        self.dispatcher = threading.Thread(target=self._dispatch, name="ray-dispatch", daemon=True)
        self.dispatcher.start()

    # ------------------------------------------------------------------------------------- workers

    def _add_worker(self) -> None:
        worker = RolloutWorker.options(num_cpus=self.cfg.rollout.worker_cpus).remote(*self.args)
        self.workers.append(worker)
        self.starting.append(worker.pid.remote())  # shards go to it once it answers (a start takes seconds)
        self.busy.append(None)
        self.idle_since.append(time.monotonic())
        self.last_checked.pop(len(self.workers) - 1, None)

    def _retire_worker(self) -> None:
        """The last worker goes (only ever when it runs nothing)."""
        worker = self.workers.pop()
        self.starting.pop()
        self.busy.pop()
        self.idle_since.pop()
        _close(worker)

    def _scale(self, backlog_checks: list[int]) -> None:
        """Elastic workers: one more while the queue has held at least as many shards as there are workers at
        two checks in a row; one fewer when the last worker has been idle for `distributed.scale_down_idle_s`."""
        n, d = len(self.workers), self.cfg.distributed
        if n < self.max_workers and len(backlog_checks) >= 2 and min(backlog_checks[-2:]) >= n:
            self._add_worker()
            self.log(f"scale up: {n} -> {n + 1} rollout workers (backlog {backlog_checks[-1]} shards)")
            self._add("dist/scale_ups", 1)
            backlog_checks.clear()
        elif (
            n > self.min_workers
            and self.busy[-1] is None
            and not self.queue
            and time.monotonic() - self.idle_since[-1] >= d.scale_down_idle_s
        ):
            self._retire_worker()
            self.log(f"scale down: {n} -> {n - 1} rollout workers (idle {d.scale_down_idle_s:g} s)")
            self._add("dist/scale_downs", 1)

    # ------------------------------------------------------------------------------------- weights

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self.reference.load_weights(model.state_dict(), version=version)
        ref = ray.put(to_numpy(model))
        d, k = self.cfg.distributed, self.cfg.rollout.max_staleness
        expected = self.probe.logprobs(self.reference), fingerprints(model)
        with self.lock:
            self.refs[version] = ref
            if d.canary_every and version % d.canary_every == 0:
                self.expected[version] = expected
            for old in [v for v in self.refs if v < version - k]:
                del self.refs[old]  # no shard of an older version will be sent again
            for old in [v for v in self.expected if v < version - k - 1]:
                del self.expected[old]  # one more kept: the movement check compares with it

    # -------------------------------------------------------------------------------------- shards

    def submit(self, specs: list[ShardSpec]) -> list[_Shard]:
        shards = [_Shard(spec) for spec in specs]
        with self.lock:
            self.queue.extend(shards)
        self.wake.set()
        return shards

    def _dispatch(self) -> None:
        """The dispatcher thread: give each idle worker the next queued shard, notice finished ones, and resize
        the pool every `distributed.scale_check_s`."""
        try:
            self._dispatch_loop()
        except BaseException as e:  # noqa: BLE001 - gather raises it in the trainer's thread
            self.failure = e

    def _dispatch_loop(self) -> None:
        checks: list[int] = []
        next_check = time.monotonic()
        while not self.stop.is_set():
            with self.lock:
                for w, ref in enumerate(self.starting):
                    if ref is not None and ray.wait([ref], timeout=0)[0]:
                        try:
                            ray.get(ref)
                            self.starting[w] = None
                        except DIED:  # still restarting (a call to it fails at once meanwhile): ask again
                            self.starting[w] = self.workers[w].pid.remote()
                for w, running in enumerate(self.busy):
                    if running is None and self.starting[w] is None and self.queue:
                        self._send(self.queue.popleft(), w)
                if time.monotonic() >= next_check:
                    checks.append(len(self.queue))
                    self._scale(checks)
                    next_check = time.monotonic() + self.cfg.distributed.scale_check_s
                running = [s.future for s in self.busy if s is not None]
            finished: set = set()
            if running:  # (one at a time: another finished meanwhile is seen at the next turn)
                finished = set(ray.wait(running, num_returns=1, timeout=0.01)[0])
            else:
                self.wake.wait(0.01)
                self.wake.clear()
            with self.lock:
                for w, shard in enumerate(self.busy):
                    if shard is not None and shard.future in finished:
                        self.busy[w], self.idle_since[w] = None, time.monotonic()

    def _send(self, shard: _Shard, worker: int) -> None:
        version = shard.spec.version
        probe = self.probe if version in self.expected else None
        shard.future = self.workers[worker].run.remote(shard.spec, [self.refs[version]], probe)
        shard.worker, self.busy[worker] = worker, shard
        shard.sent.set()

    def gather(self, ticket: list[_Shard]) -> Rollout:
        parts = []
        for shard in ticket:
            while True:
                while not shard.sent.wait(1.0):
                    if self.failure is not None:
                        raise RuntimeError(
                            f"the shard dispatcher stopped: {self.failure!r}"
                        ) from self.failure
                try:
                    rollout, check, sandbox_retries = ray.get(shard.future)
                    break
                except DIED as e:
                    if shard.attempts >= self.cfg.distributed.max_retries:
                        raise RuntimeError(
                            f"shard {shard.spec.key} failed {shard.attempts + 1} times; last: {e}"
                        ) from e
                    self.log(f"rollout worker {shard.worker} died during shard {shard.spec.key}: re-sent")
                    with self.lock:
                        self._add("dist/shard_retries", 1)
                        self.last_checked.pop(shard.worker, None)
                        if shard.worker < len(
                            self.workers
                        ):  # no more shards for it until Ray has restarted it
                            self.starting[shard.worker] = self.workers[shard.worker].pid.remote()
                        shard.attempts += 1
                        shard.sent.clear()
                        self.queue.appendleft(shard)
                    self.wake.set()
            if check is not None:
                self._check(shard.worker, shard.spec.version, *check)
            with self.lock:
                self._add("dist/sandbox_retries", sandbox_retries)
            parts.append(rollout)
        return merge_rollouts(parts)

    def _check(self, worker: int, version: int, theirs: torch.Tensor, prints: dict[str, float]) -> None:
        mine, my_prints = self.expected[version]
        last = self.last_checked.get(worker)  # (version, the worker's probe then)
        before = last is not None and last[0] in self.expected
        diff = canary.check(
            f"rollout worker {worker}",
            version,
            mine,
            theirs,
            self.cfg.distributed.canary_tol,
            mine_before=self.expected[last[0]][0] if before else None,
            theirs_before=last[1] if before else None,
            my_prints=my_prints,
            their_prints=prints,
        )
        self.last_checked[worker] = version, theirs
        self.step_metrics["sync/canary_max_abs_diff"] = max(
            self.step_metrics.get("sync/canary_max_abs_diff", 0.0), diff
        )

    def metrics(self) -> dict[str, float]:
        """This step's pool figures (and reset them)."""
        with self.lock:
            out = {
                "dist/workers": float(len(self.workers)),
                "dist/backlog": float(len(self.queue)),
                "dist/shard_retries": 0.0,
                "dist/sandbox_retries": 0.0,
                "dist/scale_ups": 0.0,
                "dist/scale_downs": 0.0,
                **self.step_metrics,
            }
            self.step_metrics = {}
        return out

    def pending_metrics(self) -> dict[str, float]:
        """The figures `metrics` would report next (gathered since the last row), left in place."""
        with self.lock:
            return dict(self.step_metrics)

    def restore_pending(self, figures: dict[str, float]) -> None:
        with self.lock:
            for key, value in figures.items():
                if key == "sync/canary_max_abs_diff":
                    self.step_metrics[key] = max(self.step_metrics.get(key, 0.0), value)
                else:
                    self._add(key, value)

    def _add(self, key: str, value: float) -> None:
        self.step_metrics[key] = self.step_metrics.get(key, 0.0) + value

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    def sandbox_pids(self) -> list[int]:
        return ray.get([s.pid.remote() for s in self.sandboxes])

    def close(self) -> None:
        self.stop.set()
        self.dispatcher.join()
        for actor in self.workers + self.sandboxes:
            _close(actor)
        self.workers, self.sandboxes = [], []
        stop_ray(self.cluster)


def _close(worker) -> None:
    try:
        ray.get(worker.close.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - a dead worker has nothing left to close
        pass
    ray.kill(worker)
