"""The hand-written kernels of the bf16 decode step (`inference.kernels`): the attention SDPA computes, over each
row's own positions only, from strided views of the cache, a group's shared positions read from one row; the
norms, activation and rotary embedding as transformers' bf16 ops round them; and the engine's bf16 sampling
with them agrees with transformers' ops and SDPA. Where the CPU lacks AVX512-BF16 the kernels are None and
these tests skip; where it has it, they must build."""

from collections import Counter

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
    assert kernels.decode_ops_for(64, 3) is not None
    assert kernels.decode_ops_for(48, 3) is None  # not a multiple of 32
    assert kernels.decode_ops_for(64, 32) is None  # more query heads per key head than it holds
    kernels.decode_ops.cache_clear()
    monkeypatch.setenv("TEMPERING_KERNELS", "0")
    try:
        assert kernels.load_decode_attention() is None
    finally:
        kernels.decode_ops.cache_clear()


class Counting:
    """The kernels' module, counting the calls of each function."""

    def __init__(self, ops):
        self.ops, self.calls = ops, Counter()

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] += 1
            return getattr(self.ops, name)(*args)

        return call


def test_bf16_sampling_with_the_kernels_agrees_with_transformers_ops(tiny, monkeypatch):
    """A Llama whose heads the kernels take (head_dim 64, 3 query heads per key head), groups of 3 samples:
    greedy bf16 decoding with the kernels gives the tokens of transformers' ops and SDPA, and log-probs within
    bf16 rounding."""
    _, tokenizer = tiny
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompts = [tokenizer("def f(x):")["input_ids"]] * 3 + [tokenizer("return x + 1")["input_ids"]] * 3

    def greedy():
        engine = LocalEngine(model, tokenizer, SamplingParams(0.0, 1.0, 24), dtype=torch.bfloat16)
        return engine.generate(prompts)

    counting = Counting(kernels.decode_ops())
    monkeypatch.setattr("tempering.inference.decoder.decode_ops_for", lambda *a: counting)
    with_kernels = greedy()
    assert counting.calls["rope_attend"] == 2 * 23  # every decode step of both layers ran the kernels
    monkeypatch.setattr("tempering.inference.decoder.decode_ops_for", lambda *a: None)
    with_aten = greedy()
    assert with_kernels.response_ids.shape[1] == 24  # decode steps ran
    # A random model's near-ties split the two later on (bf16 rounding); the first 12 tokens must agree.
    assert torch.equal(with_kernels.response_ids[:, :12], with_aten.response_ids[:, :12])
    torch.testing.assert_close(with_kernels.logprobs[:, :12], with_aten.logprobs[:, :12], atol=0.05, rtol=0)


def assert_rounded_alike(got, expected):
    """Equal to the bf16 ops' results but for a rare last bit (a sum taken in another order)."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    same = (got == expected).float().mean().item()
    assert same >= 0.99, f"only {same:.2%} equal"
    ulp = expected.float().abs() * 2**-7 + 1e-30
    assert ((got.float() - expected.float()).abs() <= ulp).all()


def test_the_norms_and_the_activation_round_as_transformers_bf16_ops():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ops = kernels.decode_ops()
    torch.manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576) * 0.1 + 1
    norm = norm.bfloat16()
    x, delta = torch.randn(32, 576).bfloat16() * 4, torch.randn(32, 576).bfloat16()
    assert_rounded_alike(ops.rms_norm(x, norm.weight, 1e-5), norm(x))
    hidden = x.clone()
    normed = ops.add_rms_norm(hidden, delta, norm.weight, 1e-5)
    assert torch.equal(hidden, x + delta)  # the residual stream, in place
    assert_rounded_alike(normed, norm(x + delta))
    gate_up = torch.randn(32, 2 * 1536).bfloat16() * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert_rounded_alike(ops.silu_mul(gate_up), F.silu(gate) * up)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.rms_norm(torch.zeros(2, 24).bfloat16(), torch.ones(24).bfloat16(), 1e-5)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_rope_attend_writes_the_rotated_cache_and_reads_a_groups_shared_prompt_from_its_leader():
    """Rows 1 and 3 share row 0's first 9 positions, and their own slots hold NaN there: they must read row 0's.
    The new keys are rotated as transformers rounds them, written at each row's position; the attention is
    fp32 attention over each row's positions (the shared ones from row 0)."""
    ops = kernels.decode_ops()
    torch.manual_seed(0)
    rows, heads, groups, dim, length, lo = 4, 2, 3, 64, 40, 1
    qkv = torch.randn(rows, (groups + 2) * heads * dim).bfloat16()
    positions = torch.tensor([12, 20, 5, 9])
    angles = positions[:, None].float() / 10000 ** (torch.arange(0, dim, 2) / dim)
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()  # fmt: skip
    cache_k, cache_v = (torch.randn(6, heads, length, dim).bfloat16() for _ in "kv")
    leader, shared = torch.tensor([0, 0, 2, 0]), torch.tensor([9, 9, 0, 9])
    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    for b in (1, 3):  # the group's copies: what they read is row 0's
        expected_k[lo + b, :, :9], expected_v[lo + b, :, :9] = cache_k[lo, :, :9], cache_v[lo, :, :9]
        cache_k[lo + b, :, :9], cache_v[lo + b, :, :9] = float("nan"), float("nan")
    heads_of = qkv.view(rows, (groups + 2) * heads, dim)
    rotated = rotate(heads_of[:, : (groups + 1) * heads], cos[:, None], sin[:, None])
    q, k, v = rotated[:, : groups * heads], rotated[:, groups * heads :], heads_of[:, (groups + 1) * heads :]
    for b, p in enumerate(positions.tolist()):
        expected_k[lo + b, :, p], expected_v[lo + b, :, p] = k[b], v[b]
    order = torch.tensor([2, 0, 3, 1])
    out = ops.rope_attend(
        qkv, cos, sin, cache_k, cache_v, positions, lo, dim**-0.5, groups, leader, shared, order
    )
    for b, p in enumerate(positions.tolist()):  # each row's new key and value, exactly
        assert torch.equal(cache_k[lo + b, :, p], expected_k[lo + b, :, p])
        assert torch.equal(cache_v[lo + b, :, p], expected_v[lo + b, :, p])
    window = slice(lo, lo + rows)
    attention = reference(
        q.reshape(rows, heads, groups, dim), expected_k[window], expected_v[window], positions + 1, dim**-0.5
    )
    torch.testing.assert_close(out.float(), attention.reshape(rows, -1), atol=1e-2, rtol=1e-2)
    bad = dict(leader=leader, shared=shared, order=torch.tensor([0, 0, 1, 2]))
    with pytest.raises(RuntimeError, match="permutation"):
        ops.rope_attend(qkv, cos, sin, cache_k, cache_v, positions, lo, 1.0, groups, *bad.values())
    with pytest.raises(RuntimeError, match="does not hold"):  # row 2 (position 5) cannot share 9 positions
        ops.rope_attend(
            qkv, cos, sin, cache_k, cache_v, positions, lo, 1.0, groups, leader, torch.tensor([9, 9, 9, 9]),
            torch.arange(4),
        )  # fmt: skip


def test_sampling_bf16_logits_draws_from_the_softmax_and_greedy_takes_the_first_largest():
    from tempering.inference.sampling import sample

    ops = kernels.decode_ops()
    torch.manual_seed(0)
    logits = (torch.randn(1, 40) * 2).bfloat16()
    draws = 100_000
    tokens, logprobs = ops.sample_rows(
        logits.expand(draws, 40).contiguous(), torch.full((draws,), 0.7), torch.rand(draws)
    )
    expected = torch.softmax(logits.float() / 0.7, -1)[0]
    assert (torch.bincount(tokens, minlength=40) / draws - expected).abs().max() < 0.006  # ~4 sd
    torch.testing.assert_close(logprobs, expected.log()[tokens], atol=1e-5, rtol=0)
    tied = torch.tensor([[0.0, 3.0, 1.0, 3.0]]).bfloat16()
    token, logprob = ops.sample_rows(tied, torch.zeros(1), torch.rand(1))  # greedy: log-prob at t = 1
    assert token.item() == 1
    assert logprob.item() == pytest.approx(torch.log_softmax(tied.float(), -1)[0, 1].item())
    # The engine's sampler takes this path for bf16 rows (the same draw as the ATen path's, given the same
    # uniform numbers, but for a weight's last bits), and the ATen path where a row asks for top-p.
    batch = (torch.randn(16, 500) * 3).bfloat16()
    t, u, full = torch.full((16,), 0.8), torch.rand(16), torch.ones(16)
    fused, aten = sample(batch, t, full, u), sample(batch.float(), t, full, u)
    assert torch.equal(fused.tokens, aten.tokens)
    torch.testing.assert_close(fused.logprobs, aten.logprobs, atol=1e-5, rtol=0)
    nucleus = sample(batch, t, torch.full((16,), 0.5), u)  # top-p: the ATen path's cut
    assert torch.equal(nucleus.tokens, sample(batch.float(), t, torch.full((16,), 0.5), u).tokens)
