"""Rotary embeddings from a table (`models.rotary`): within an ulp of transformers' own, the same floats in
every process (no call to torch's MKL cos), and fp32 angles in a bf16 copy."""

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tempering.models.loading import load_model
from tempering.models.rotary import RotaryTable
from tests.helpers.architectures import FAMILIES, build

ULP = 2.0**-24  # half an fp32 ulp at 1: the table is correctly rounded, torch's cos within an ulp


@pytest.mark.parametrize("name", [name for name in FAMILIES if name != "gpt2"])  # (gpt2: learned positions)
def test_a_loaded_models_rotary_embedding_is_a_table_within_an_ulp_of_transformers_own(tmp_path, name):
    path = build(name, tmp_path / name)
    model, own = load_model(path), AutoModelForCausalLM.from_pretrained(path)
    assert [type(m) for m in model.modules() if isinstance(m, RotaryTable)] == [RotaryTable]
    positions = torch.arange(3000)[None]
    x = torch.zeros(1)
    for table, theirs in zip(model.model.rotary_emb(x, positions), own.model.rotary_emb(x, positions)):
        assert table.dtype == torch.float32 and (table - theirs).abs().max() <= 2 * ULP
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, own(ids).logits, atol=1e-5)


def test_a_bf16_copy_keeps_the_fp32_angles_that_transformers_own_module_loses_in_the_cast(tmp_path):
    path = build("llama", tmp_path / "llama")
    model = load_model(path)
    positions, x = torch.arange(4096)[None], torch.zeros(1, dtype=torch.bfloat16)
    fp32 = [t.to(torch.bfloat16) for t in model.model.rotary_emb(torch.zeros(1), positions)]
    copied = copy.deepcopy(model).to(torch.bfloat16).model.rotary_emb(x, positions)
    assert all(torch.equal(a, b) for a, b in zip(copied, fp32))
    theirs = AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).model.rotary_emb(x, positions)
    assert (theirs[0].float() - fp32[0].float()).abs().max() > 0.1  # its inv_freq was cast to bf16


def test_the_table_never_calls_torchs_cos_or_sin_whose_mkl_code_path_varies_between_processes(monkeypatch):
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=10000.0))
    grown = RotaryTable(rotary)
    grown(torch.zeros(1), torch.arange(10)[None])  # a small table first, grown below

    def refuse(*args, **kwargs):
        raise AssertionError("torch's cos or sin called")

    for name in ("cos", "sin"):
        monkeypatch.setattr(torch, name, refuse)
        monkeypatch.setattr(torch.Tensor, name, refuse)
    positions = torch.tensor([[0, 1, 299], [700, 5, 6]])
    cos, sin = grown(torch.zeros(1), positions)
    angles = (
        positions[..., None].numpy().astype(np.float32) * rotary.inv_freq.numpy()
    )  # fp32, as transformers
    angles = np.concatenate([angles, angles], -1).astype(np.float64)
    assert cos.shape == (2, 3, 32) and np.array_equal(cos.numpy(), np.cos(angles).astype(np.float32))
    assert np.array_equal(sin.numpy(), np.sin(angles).astype(np.float32))
    fresh = RotaryTable(rotary)(torch.zeros(1), positions)
    assert torch.equal(fresh[0], cos) and torch.equal(fresh[1], sin)
