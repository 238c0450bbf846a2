"""The Ray backend on a local loopback cluster: the same rows as the local backend (synchronous, and
asynchronous with shards on two workers), a killed worker's shards re-sent with identical results, the
weight-sync canary against three sabotaged syncs, and exact resume of an asynchronous run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.runs import ROOT, metrics, tempering

ray = pytest.importorskip("ray")
# One xdist worker runs these in turn (make test runs two workers): one local Ray cluster at a time.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.xdist_group("ray")]

SHORT = ("sft.steps=8", "train.steps=4")
ASYNC = ("rollout.max_staleness=1", "rollout.shards=4")
TWO = ("distributed.backend=ray", "rollout.workers=2", "rollout.worker_cpus=0.5")
POOL = ("timing_s/", "perf/", "dist/", "sync/")  # the pool's own figures: where and how long, not what


def not_timing(row):
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "dist/backlog"))}


def same(rows):
    return [{k: v for k, v in r.items() if not k.startswith(POOL)} for r in rows]


def run(run_dir, *overrides):
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *SHORT, *overrides)
    return metrics(run_dir)


def run_here(run_dir, *overrides) -> int:
    """The run in this process (so a test can patch the pool); the CLI's exit code."""
    from tempering.cli import main

    return main(["train", str(ROOT / "configs" / "smoke.yaml"), f"run.dir={run_dir}", *SHORT, *overrides])


@pytest.fixture(scope="module")
def local_async(tmp_path_factory):
    return run(tmp_path_factory.mktemp("local") / "async", *ASYNC)


@pytest.fixture(scope="module")
def local_sync(tmp_path_factory):
    return run(tmp_path_factory.mktemp("local") / "sync")


def test_one_synchronous_worker_writes_the_local_backends_rows(tmp_path, local_sync):
    local = local_sync
    remote = run(tmp_path / "ray", "distributed.backend=ray")
    compared = {k for r in same(local) for k in r}
    assert len(compared) >= 30
    assert same(remote) == same(local)
    assert all(r["sync/canary_max_abs_diff"] == 0.0 and r["dist/workers"] == 1 for r in remote)


@pytest.fixture(scope="module")
def ray_async(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ray") / "async", *ASYNC, *TWO)


def test_two_asynchronous_workers_write_the_local_backends_rows(ray_async, local_async):
    remote = ray_async
    assert same(remote) == same(local_async)
    assert [r["async/staleness/max"] for r in remote] == [0, 1, 1, 1]


def test_a_killed_worker_s_shards_are_re_sent_and_nothing_changes(tmp_path, local_async, monkeypatch):
    from tempering.distributed.ray_pool import RayPool

    submit, killed = RayPool.submit, []

    def submit_then_kill(self, specs):
        if not hasattr(self, "pids"):
            self.pids = self.worker_pids()  # while the workers are idle
        ticket = submit(self, specs)
        if specs[0].step == 3 and not killed:  # step 3's shards are on their way: worker 0 dies now
            os.kill(self.pids[0], signal.SIGKILL)
            killed.append(self.pids[0])
        return ticket

    monkeypatch.setattr(RayPool, "submit", submit_then_kill)
    assert run_here(tmp_path / "killed", *ASYNC, *TWO) == 0
    rows = metrics(tmp_path / "killed")
    assert killed and sum(r["dist/shard_retries"] for r in rows) >= 1
    assert same(rows) == same(local_async)
    samples = [
        json.loads(line)
        for f in sorted((tmp_path / "killed" / "samples").glob("step_*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    assert len(samples) == 4 * 4 * 4  # steps x prompts x group, none lost, none twice


@pytest.mark.parametrize(
    "sabotage, overrides",
    [("no-op", ()), ("one tensor skipped", ()), ("LoRA adapters not loaded", ("model.lora.r=4",))],
)
def test_a_sync_that_did_not_happen_fails_at_the_first_version(
    tmp_path, monkeypatch, capsys, sabotage, overrides
):
    from tempering.distributed.ray_pool import RayPool

    def noop(model, arrays):
        pass

    def skip_one(model, arrays):
        from tempering.distributed.weights import load_numpy

        load_numpy(model, dict(list(arrays.items())[1:]))

    def no_adapters(model, arrays):
        from tempering.distributed.weights import load_numpy

        load_numpy(model, {k: v for k, v in arrays.items() if "lora_" not in k})

    load = {"no-op": noop, "one tensor skipped": skip_one, "LoRA adapters not loaded": no_adapters}[sabotage]
    monkeypatch.setattr(RayPool, "load", staticmethod(load))
    assert run_here(tmp_path / "run", "distributed.backend=ray", *overrides) == 2
    error = capsys.readouterr().err
    assert "weight sync failed on rollout worker 0 at version 1" in error, error
    assert "first differing tensor" in error
    if sabotage == "one tensor skipped":
        from tempering.distributed.weights import trained
        from tempering.models.loading import load_model

        first = next(iter(trained(load_model(tmp_path / "run" / "sft" / "model"))))
        assert f"first differing tensor: {first} (1 of" in error
    assert [r["step"] for r in metrics(tmp_path / "run")] == [
        1
    ]  # nothing sampled by unverified weights trained


def test_sigterm_at_step_3_then_resume_equals_the_uninterrupted_asynchronous_run(
    tmp_path, local_async, ray_async
):
    """Every figure but timings, also the pool's: the weight-sync check of the look-ahead batches (gathered
    when the checkpoint was taken) is in the next row, resumed or not."""
    run_dir = tmp_path / "stopped"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tempering.cli",
            "train",
            "configs/smoke.yaml",
            f"run.dir={run_dir}",
            *SHORT,
            *ASYNC,
            *TWO,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # during step 3
        if (run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 2:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert "preempted" in proc.stderr.read()
    stopped_at = len(metrics(run_dir))
    assert stopped_at < 4 and (run_dir / "checkpoints" / f"step_{stopped_at:06d}" / "lookahead.pt").is_file()
    resumed = run(run_dir, *ASYNC, *TWO)
    assert same(resumed) == same(local_async)
    # dist/backlog samples the queue when a row is written: how far the workers got is timing. Right after a
    # resume the workers are up, as in the uninterrupted run: not all of the next step's 4 shards still queued.
    assert [not_timing(r) for r in resumed] == [not_timing(r) for r in ray_async]
    assert resumed[stopped_at]["dist/backlog"] <= 2


def test_the_pool_grows_with_a_backlog_and_shrinks_when_idle_and_nothing_changes(tmp_path):
    """One worker at the start, up to three: the first steps queue 8 shards (steps 1 and 2, k=1), so workers are
    added; a slow update (16 PPO epochs) leaves them idle, so they are retired. The rows are the local run's."""
    slow = (*ASYNC, "algo.ppo_epochs=16")
    local = run(tmp_path / "local", *slow)
    assert (
        run_here(
            tmp_path / "elastic",
            *slow,
            "distributed.backend=ray",
            "rollout.workers=1",
            "rollout.max_workers=3",
            "rollout.worker_cpus=0.5",
            "distributed.scale_check_s=0.05",
            "distributed.scale_down_idle_s=0.2",
        )
        == 0
    )
    rows = metrics(
        tmp_path / "elastic"
    )  # (each event is also a log line: "scale up: 1 -> 2 rollout workers ...")
    assert sum(r["dist/scale_ups"] for r in rows) >= 1 and sum(r["dist/scale_downs"] for r in rows) >= 1
    assert max(r["dist/workers"] for r in rows) >= 2
    assert same(rows) == same(local)


def test_killed_sandbox_actors_have_their_batches_re_sent_and_nothing_changes(
    tmp_path, local_async, monkeypatch
):
    """Two sandbox actors serve both rollout workers; from step 2 on, sandbox actor 0 is SIGKILLed again and
    again (Ray restarts it, ~2 s each time) for two seconds: its batches go to the other actor, and the rows are the same."""
    import threading

    from tempering.distributed.ray_pool import RayPool

    submit, kills = RayPool.submit, []

    def keep_killing(actor):
        deadline = None
        while deadline is None or time.monotonic() < deadline:
            try:
                pid = ray.get(actor.pid.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - it is restarting
                continue
            deadline = deadline or time.monotonic() + 2.0
            os.kill(pid, signal.SIGKILL)
            kills.append(pid)
            time.sleep(0.15)

    def submit_and_start_killing(self, specs):
        ticket = submit(self, specs)
        if specs[0].step == 3 and not kills:  # at the start of step 2: every actor is up and serving
            threading.Thread(target=keep_killing, args=(self.sandboxes[0],), daemon=True).start()
        return ticket

    monkeypatch.setattr(RayPool, "submit", submit_and_start_killing)
    assert run_here(tmp_path / "run", *ASYNC, *TWO, "distributed.sandbox_actors=2") == 0
    rows = metrics(tmp_path / "run")
    assert kills and sum(r["dist/sandbox_retries"] for r in rows) >= 1, (
        kills,
        [r["dist/sandbox_retries"] for r in rows],
    )
    assert same(rows) == same(local_async)
    statuses = [
        t.get("status")
        for f in (tmp_path / "run" / "samples").glob("step_*.jsonl")
        for line in f.read_text().splitlines()
        for t in json.loads(line)["turns"]
    ]
    assert "sandbox_error" not in statuses and len(statuses) == 4 * 4 * 4


def test_two_data_parallel_trainers_train_as_the_local_trainer(tmp_path, local_sync):
    """Rank 0 here and one trainer actor, each half of every minibatch: the same samples, and the update's
    figures equal to float summation order (the replicas' weights are checked bit for bit every step)."""
    rows = run(tmp_path / "dp", "distributed.backend=ray", "distributed.trainers=2")
    assert all(r["dist/trainers"] == 2 for r in rows)
    for mine, local in zip(same(rows), same(local_sync), strict=True):
        assert mine.keys() == local.keys()
        update = {k for k in local if k.startswith(("actor/", "critic/"))}
        assert {k: v for k, v in mine.items() if k not in update} == {
            k: v for k, v in local.items() if k not in update
        }
        assert {k: mine[k] for k in update} == pytest.approx(
            {k: local[k] for k in update}, rel=1e-3, abs=1e-6
        )


def test_a_trainer_actor_that_dies_stops_the_run_with_its_name_and_resume_finishes_it(
    tmp_path, monkeypatch, capsys
):
    from tempering.distributed.ray_trainers import TrainerGroup

    update, killed = TrainerGroup.update, []

    def kill_then_update(self, step, *args):
        if step == 3 and not killed:
            pid = ray.get(self.actors[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return update(self, step, *args)

    monkeypatch.setattr(TrainerGroup, "update", kill_then_update)
    dp = ("distributed.backend=ray", "distributed.trainers=2", "checkpoint.every=1")
    assert run_here(tmp_path / "run", *dp) == 2
    assert "trainer rank 1 died during step 3" in capsys.readouterr().err
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
    monkeypatch.setattr(TrainerGroup, "update", update)
    assert run_here(tmp_path / "run", *dp) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4]
