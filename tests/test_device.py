"""Device handling that this CPU machine can check: `run.device` resolution, batches moving to a device,
and sampling generators that follow the model's device. The CUDA runs themselves are in tests/test_gpu.py."""

import pytest
import torch

from tempering.config import load_config
from tempering.errors import ConfigError
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.models.loading import resolve_device
from tempering.rollout.batch import RolloutBatch
from tests.helpers.runs import tempering


def test_auto_picks_cuda_only_when_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cpu") == "cpu"


def test_a_missing_cuda_device_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"run.device=cuda but this machine has no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(ConfigError, match=r"run.device=cuda:1 but this machine has 1 CUDA device"):
        resolve_device("cuda:1")


def test_device_names_are_checked_when_the_config_loads():
    assert load_config("configs/smoke.yaml").run.device == "auto"
    with pytest.raises(ConfigError, match="run.device"):
        load_config("configs/smoke.yaml", ["run.device=gpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_train_on_cuda_without_one_fails_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    proc = tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}", "run.device=cuda", check=False)
    assert proc.returncode == 2
    assert "run.device=cuda but this machine has no CUDA device" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not run_dir.exists()


def test_batch_to_moves_every_tensor_and_keeps_none():
    b = RolloutBatch(
        prompt_ids=torch.ones(2, 3, dtype=torch.long),
        prompt_mask=torch.ones(2, 3),
        response_ids=torch.ones(2, 4, dtype=torch.long),
        response_mask=torch.ones(2, 4),
        old_logprobs=torch.zeros(2, 4),
        rewards=torch.zeros(2),
        group_ids=torch.zeros(2),
    )
    moved = b.to("meta")
    assert all(getattr(moved, n).device.type == "meta" for n in ("prompt_ids", "response_mask", "group_ids"))
    assert moved.advantages is None and moved.values is None
    assert b.prompt_ids.device.type == "cpu"  # the original is untouched


def test_generation_returns_cpu_tensors_and_repeats_from_a_cpu_generator(tiny, tasks):
    model, tok = tiny
    engine = LocalEngine(model, tok, SamplingParams(max_new_tokens=6))
    prompts = [tok(t.prompt).input_ids for t in tasks[0][:3]]
    a = engine.generate(prompts, generator=torch.Generator().manual_seed(5))
    b = engine.generate(prompts, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.response_ids, b.response_ids)
    assert a.response_ids.device.type == a.logprobs.device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU check's no-GPU answer")
def test_the_gpu_check_says_in_one_line_that_there_is_no_gpu(tmp_path):
    """`make gpu-check` on a machine without CUDA: one line naming why nothing ran, exit 0, nothing started."""
    import subprocess
    import sys

    from tests.helpers.runs import ROOT

    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py")], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check"
    ]
    assert list(tmp_path.iterdir()) == []
