"""The CUDA path (marker `gpu`; skipped where torch sees no CUDA device): sampling, the forward passes and
the update with the model on the GPU and batches on the CPU, and a smoke run (SFT + RL) killed after a
checkpoint that resumes on the GPU."""

import json

import pytest
import torch

from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.models.forward import distinct_rows, response_logprobs
from tempering.rollout.batch import RolloutBatch
from tempering.training.update import UpdateSettings, update_policy
from tests.helpers.runs import kill_after_checkpoint, metrics, stable, tempering

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture()
def tiny_cuda(tiny):
    model, tok = tiny
    return model.to("cuda"), tok


def test_distinct_rows_on_cuda():
    ids = torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6]])
    first, inverse = distinct_rows(ids.cuda())
    ref_first, ref_inverse = distinct_rows(ids)
    assert first.device.type == "cuda"
    assert first.cpu().tolist() == ref_first.tolist() and inverse.cpu().tolist() == ref_inverse.tolist()


def test_sampling_on_cuda_with_a_cpu_generator_matches_the_forward_pass(tiny_cuda, tasks):
    model, tok = tiny_cuda
    prompts = [tok(t.prompt).input_ids for t in tasks[0][:4] for _ in range(3)]  # groups share prefill
    engine = LocalEngine(model, tok, SamplingParams(0.9, 0.95, 8))
    gens = [engine.generate(prompts, generator=torch.Generator().manual_seed(11)) for _ in range(2)]
    assert torch.equal(gens[0].response_ids, gens[1].response_ids)  # repeatable from the CPU seed
    g = gens[0]
    assert g.response_ids.device.type == "cpu"
    logprobs, _ = response_logprobs(
        model, g.prompt_ids, g.prompt_mask, g.response_ids, g.response_mask, temperature=0.9
    )
    assert logprobs.device.type == "cuda"
    torch.testing.assert_close((logprobs.cpu() * g.response_mask), g.logprobs, atol=2e-4, rtol=0)
    greedy = engine.generate(prompts[:2], greedy=True)
    assert greedy.response_ids.shape[0] == 2


def test_update_moves_cpu_minibatches_to_the_model(tiny_cuda, tasks):
    from tempering.algos import POLICY_LOSSES
    from tempering.training.optim import make_optimizer

    model, tok = tiny_cuda
    prompts = [tok(t.prompt).input_ids for t in tasks[0][:4] for _ in range(2)]
    g = LocalEngine(model, tok, SamplingParams(max_new_tokens=6)).generate(
        prompts, generator=torch.Generator().manual_seed(0)
    )
    batch = RolloutBatch(
        prompt_ids=g.prompt_ids,
        prompt_mask=g.prompt_mask,
        response_ids=g.response_ids,
        response_mask=g.response_mask,
        old_logprobs=g.logprobs,
        rewards=torch.arange(8, dtype=torch.float32),
        group_ids=torch.arange(8) // 2,
    )
    batch.advantages = (batch.rewards - 3.5)[:, None] * batch.response_mask
    before = [p.detach().clone() for p in model.parameters()]
    metrics_ = update_policy(
        model,
        make_optimizer(model, lr=1e-3),
        batch,
        POLICY_LOSSES["ppo_clip"],
        UpdateSettings(minibatches=2),
        torch.Generator().manual_seed(0),
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics_.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.slow
def test_smoke_run_on_cuda_resumes_after_a_kill(tmp_path):
    reference, killed = tmp_path / "ref", tmp_path / "killed"
    tempering("train", "configs/smoke.yaml", f"run.dir={reference}", "run.device=cuda")
    kill_after_checkpoint(killed, 2, "run.device=cuda")
    tempering("train", "configs/smoke.yaml", f"run.dir={killed}", "run.device=cuda")
    assert "device: cuda" in (reference / "config.yaml").read_text()
    ref_rows, rows = stable(metrics(reference)), stable(metrics(killed))
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == list(range(1, 7))
    for a, b in zip(
        ref_rows, rows
    ):  # GPU kernels may reorder float sums between processes: near, not bitwise
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-4), k
    summary = json.loads((reference / "summary.json").read_text())
    assert 0 <= summary["heldout_pass@1_after"] <= 1
