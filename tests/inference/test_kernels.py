"""The hand-written decode-attention kernel (`inference.kernels`): the attention SDPA computes, over each row's
own positions only, from strided views of the cache; and the engine's bf16 sampling with it agrees with the
SDPA path. Where the CPU lacks AVX512-BF16 the kernel is None and these tests skip; where it has it, the
kernel must build."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tempering.inference import kernels
from tempering.inference.engine import LocalEngine, SamplingParams

pytestmark = pytest.mark.skipif(
    not {"avx512f", "avx512_bf16"} <= kernels._cpu_flags(), reason="the CPU lacks AVX512-BF16"
)


def reference(q, k, v, lengths, scale):
    """fp32 attention of q (B, H, G, D) over positions [0, lengths[b]) of k, v (B, H, W, D)."""
    keep = torch.arange(k.shape[2])[None] < lengths[:, None]
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=keep[:, None, None], scale=scale
    )


@pytest.mark.parametrize("groups,dim", [(3, 64), (1, 128), (4, 32)])
def test_the_kernel_is_attention_over_each_rows_own_positions(groups, dim):
    kernel = kernels.load_decode_attention()
    assert kernel is not None, "AVX512-BF16 is here: the kernel must build"
    torch.manual_seed(0)
    rows, heads, width = 5, 2, 70
    cache_k = torch.randn(8, heads, 96, dim).bfloat16()  # the cache: more slots and positions than read
    cache_v = torch.randn(8, heads, 96, dim).bfloat16()
    lengths = torch.tensor([1, 17, 70, 33, 64])
    for b, n in enumerate(lengths.tolist()):  # past a row's length: garbage it must not read
        cache_k[b, :, n:] = float("nan")
        cache_v[b, :, n:] = float("inf")
    k, v = cache_k[:rows, :, :width], cache_v[:rows, :, :width]  # strided views, as the engine passes them
    q = torch.randn(rows, heads * groups, 2, dim).bfloat16()[:, :, 0].reshape(rows, heads, groups, dim)
    assert not q.is_contiguous()
    out = kernel(q, k, v, lengths, dim**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected = reference(q, k.nan_to_num(0, 0, 0), v.nan_to_num(0, 0, 0), lengths, dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_a_bad_tensor_is_one_error_not_a_wrong_answer():
    kernel = kernels.load_decode_attention()
    q, k = torch.zeros(2, 1, 1, 64).bfloat16(), torch.zeros(2, 1, 8, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bf16"):
        kernel(q.float(), k, k, torch.tensor([1, 1]), 1.0)
    with pytest.raises(RuntimeError, match="lengths"):
        kernel(q, k, k, torch.tensor([1, 1], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(
            q[..., :48].contiguous(),
            k[..., :48].contiguous(),
            k[..., :48].contiguous(),
            torch.tensor([1, 1]),
            1.0,
        )


def test_the_kernel_is_off_where_asked_or_where_heads_do_not_fit(monkeypatch):
    assert kernels.decode_attention_for(64, 3) is not None
    assert kernels.decode_attention_for(48, 3) is None  # not a multiple of 32
    assert kernels.decode_attention_for(64, 32) is None  # more query heads per key head than it holds
    kernels.load_decode_attention.cache_clear()
    monkeypatch.setenv("TEMPERING_KERNELS", "0")
    try:
        assert kernels.load_decode_attention() is None
    finally:
        kernels.load_decode_attention.cache_clear()


def test_bf16_sampling_with_the_kernel_agrees_with_sdpa(tiny, monkeypatch):
    """A Llama whose heads the kernel takes (head_dim 64, 3 query heads per key head): greedy bf16 decoding
    with the kernel gives the SDPA path's tokens, and log-probs within bf16 rounding."""
    _, tokenizer = tiny
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompts = [tokenizer("def f(x):")["input_ids"], tokenizer("return x + 1")["input_ids"]]

    def greedy():
        engine = LocalEngine(model, tokenizer, SamplingParams(0.0, 1.0, 24), dtype=torch.bfloat16)
        return engine.generate(prompts)

    with_kernel = greedy()
    monkeypatch.setattr("tempering.inference.decoder.decode_attention_for", lambda *a: None)
    with_sdpa = greedy()
    assert with_kernel.response_ids.shape[1] == 24  # decode steps ran
    # A random model's near-ties split the two later on (bf16 rounding); the first 12 tokens must agree.
    assert torch.equal(with_kernel.response_ids[:, :12], with_sdpa.response_ids[:, :12])
    torch.testing.assert_close(with_kernel.logprobs[:, :12], with_sdpa.logprobs[:, :12], atol=0.05, rtol=0)
