"""vLLM inside the Ray rollout workers (`rollout.engine: vllm`, `distributed.backend: ray`; `make test-vllm`):
each worker its own vLLM engine over its copy of the weights, new weights reloaded in place at every version.
The rows equal the local backend's with vLLM; a killed worker's shards are re-sent and nothing changes; a
sync that did not happen fails the canary at the first version."""

import subprocess
import sys

import pytest

from tests.distributed.test_ray import ASYNC, SHORT, TWO, run, same
from tests.helpers.runs import ROOT, metrics

pytest.importorskip("ray")
pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow, pytest.mark.xdist_group("ray")]

VLLM = ("rollout.engine=vllm",)


@pytest.fixture(scope="module")
def local_vllm(tmp_path_factory):
    return run(tmp_path_factory.mktemp("local") / "vllm", *ASYNC, *VLLM)


def test_two_workers_with_vllm_write_the_local_vllm_runs_rows(tmp_path, local_vllm):
    remote = run(tmp_path / "ray", *ASYNC, *TWO, *VLLM)
    assert len(remote) == 4 and same(remote) == same(local_vllm)
    assert all(r["sync/canary_max_abs_diff"] <= 1e-4 for r in remote if "sync/canary_max_abs_diff" in r)
    assert [r["async/staleness/max"] for r in remote] == [0, 1, 1, 1]


KILL_AT_STEP_3 = """
import os, signal
from tempering.distributed.ray_pool import RayPool
submit = RayPool.submit
def submit_then_kill(self, specs):
    if not hasattr(self, "pids"):
        self.pids = self.worker_pids()
    ticket = submit(self, specs)
    if specs[0].step == 3 and not getattr(RayPool, "killed", None):
        os.kill(self.pids[0], signal.SIGKILL)
        RayPool.killed = self.pids[0]
    return ticket
RayPool.submit = submit_then_kill
"""
NO_LOAD = """
from tempering.distributed.ray_pool import RayPool
RayPool.load = staticmethod(lambda model, arrays: None)
"""


def run_patched(patch: str, run_dir, *overrides) -> subprocess.CompletedProcess:
    """The run in a process of its own with `patch` applied first: each vLLM engine of a process keeps its
    KV cache until the process ends, so two runs in one process would not both find the memory."""
    args = ["train", str(ROOT / "configs" / "smoke.yaml"), f"run.dir={run_dir}", *SHORT, *overrides]
    code = f"{patch}\nimport sys\nfrom tempering.cli import main\nsys.exit(main({args!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_a_killed_vllm_worker_s_shards_are_re_sent_and_nothing_changes(tmp_path, local_vllm):
    proc = run_patched(KILL_AT_STEP_3, tmp_path / "killed", *ASYNC, *TWO, *VLLM)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = metrics(tmp_path / "killed")
    assert sum(r["dist/shard_retries"] for r in rows) >= 1
    assert same(rows) == same(local_vllm)


def test_a_vllm_worker_that_kept_its_old_weights_fails_at_the_first_version(tmp_path):
    proc = run_patched(NO_LOAD, tmp_path / "run", "distributed.backend=ray", *VLLM)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "weight sync failed on rollout worker 0 at version 1" in proc.stderr, proc.stderr[-2000:]
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]
