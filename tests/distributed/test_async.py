"""Asynchronous rollouts on the local backend (the reference the Ray backend equals): the lag, exact resume
with the look-ahead batches in the checkpoint, and the mismatch correction in a synchronous run."""

import pytest

from tests.helpers.runs import kill_after_checkpoint, metrics, stable, tempering, versions

SHORT = ("sft.steps=8",)


def run(run_dir, *overrides):
    tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", *SHORT, *overrides)
    return metrics(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_staleness_is_bounded_by_k_and_a_resumed_run_equals_an_uninterrupted_one(tmp_path, k):
    rows = run(tmp_path / "straight", f"rollout.max_staleness={k}")
    assert [r["async/staleness/max"] for r in rows] == [min(k, s - 1) for s in range(1, 7)]
    assert [r["async/staleness/min"] for r in rows] == [min(k, s - 1) for s in range(1, 7)]
    assert versions(tmp_path / "straight") == {s: {max(0, s - 1 - k)} for s in range(1, 7)}
    killed = tmp_path / "killed"
    kill_after_checkpoint(killed, 2, *SHORT, f"rollout.max_staleness={k}")
    saved = killed / "checkpoints" / "step_000002" / "lookahead.pt"
    assert saved.is_file()  # steps 3 .. 2 + k, sampled before the kill
    import torch

    assert sorted(torch.load(saved, weights_only=False)) == list(range(3, min(2 + k, 6) + 1))
    resumed = run(killed, f"rollout.max_staleness={k}")
    assert stable(resumed) == stable(rows)


@pytest.mark.slow
def test_a_synchronous_run_has_no_staleness_and_tis_weights_near_one(tmp_path):
    rows = run(tmp_path / "tis", "algo.correction=tis")
    assert all(r["async/staleness/max"] == 0 for r in rows)
    for r in rows:  # the sampler and the trainer's recompute agree: the same weights, the same floats nearly
        assert r["mismatch/kl"] < 1e-6
        assert abs(r["mismatch/is_weight/mean"] - 1) < 1e-3
        assert r["mismatch/clip_frac"] == 0.0
