"""The engine's forward pass for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3): transformers' own
layers' operations, in the same order on the same tensors - bitwise the same hidden states (tested) - without
the per-layer Python around them (keyword plumbing, decorators, the mask builder, the attention registry).
At SmolLM2's 30 layers that Python is a tenth of a 32-row decode step: measured 1.07x the step, fp32 and
bf16 alike. In the engine's packed bf16 copy, q, k and v are one matmul, and so are the MLP's gate and up
(`engine.fuse`). The modules themselves (projections, norms, activation, rotary embedding) are called as
they are, so LoRA layers, pre-packed bf16 projections and biases behave as in the model's own forward. Any
other architecture runs the model's own forward (`LlamaDecoder.of` returns None).

A bf16 one-token step on a CPU with the kernels of `kernels/` runs them: in the packed copy, each layer is
its four matmuls and three kernels (`_step`; norms, rotary, cache write, attention, activation, residuals),
rounded where transformers' ops round; elsewhere (a LoRA or unpacked copy) the attention alone is a kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tempering.inference.kernels import decode_ops_for

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
"""`config.model_type`s whose decoder layers are: norm, attention (q/k/v projections, optional per-head q/k
norms, rotary embedding, o projection), residual, norm, gated MLP, residual."""


class LlamaDecoder:
    def __init__(self, model, attention):
        decoder = model.get_decoder()
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        config = model.config
        self.layers = list(decoder.layers[: config.num_hidden_layers])
        self.head_dim = self.layers[0].self_attn.head_dim
        self.queries = config.num_attention_heads
        self.heads = self.queries + (
            config.num_key_value_heads or config.num_attention_heads
        )  # query + key heads
        self.attention = attention
        self.groups = self.queries // (self.heads - self.queries)
        self.norms = _norms(self.layers, self.norm) if _packed(self.layers, self.norm, config) else None
        self.plan = [  # each layer's four projections, as functions
            tuple(
                _function(m)
                for m in (
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                )
            )
            for layer in (self.layers if self.norms is not None else [])
        ]

    @property
    def fused(self) -> bool:
        """Whether a bf16 one-token step can run `_step` (the packed copy); the kernels decide at the step."""
        return self.norms is not None

    @classmethod
    def of(cls, model, attention) -> LlamaDecoder | None:
        """The fast forward for `model` (a transformers causal LM, peft's base model included), attending with
        `attention` (the engine's attention function); None where the architecture is not of the family."""
        if getattr(model.config, "model_type", None) not in FAMILY:
            return None
        decoder = model.get_decoder()
        if not all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return None
        return cls(model, attention)

    def __call__(self, ids: Tensor, positions: Tensor, mask: Tensor, cache) -> Tensor:
        """The last hidden states (B, T, H) of tokens `ids` (B, T) at `positions` (B, T), attending where `mask`
        (B, 1, T, width) is true; keys and values go into `cache` (the engine's `SlotCache`, batch already set)."""
        b, t = ids.shape
        hidden = self.embed(ids)
        kernel, lengths = None, None
        if t == 1 and hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu":
            # one token attends to every position up to its own: the kernels, where they run (else SDPA)
            ops = decode_ops_for(self.head_dim, self.groups)
            if ops is not None and self.fused:
                return self._step(ops, hidden.view(b, -1), positions, cache).view(b, 1, -1)
            kernel = None if ops is None else ops.decode_attention
            lengths = positions[:, 0] + 1
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): broadcast over heads
        shape = (b, t, -1, self.head_dim)
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(hidden)
            if hasattr(attn, "qkv_proj"):  # the packed bf16 copy (`engine.fuse`): one matmul, q and k rotated
                qkv = attn.qkv_proj(x).view(shape)  # (B, T, Hq + 2 Hkv, D)
                rotated = _rotate(qkv[:, :, : self.heads].transpose(1, 2), cos, sin)
                q, k = rotated[:, : self.queries], rotated[:, self.queries :]
                v = qkv[:, :, self.heads :].transpose(1, 2)
            else:
                q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
                if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before rotary
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
                v = attn.v_proj(x).view(shape).transpose(1, 2)
            k, v = cache.update(k, v, index)
            if kernel is not None:  # (B, Hkv, G, D): the query heads of each key head together
                out = kernel(q.reshape(b, k.shape[1], -1, self.head_dim), k, v, lengths, attn.scaling)
            else:
                out, _ = self.attention(attn, q, k, v, mask, attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(b, t, -1).contiguous())
            x = layer.post_attention_layernorm(hidden)
            if hasattr(mlp, "gate_up_proj"):  # the packed bf16 copy: gate and up one matmul
                gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
                hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.norm(hidden)

    def _step(self, ops, hidden: Tensor, positions: Tensor, cache) -> Tensor:
        """A one-token step of the packed bf16 copy, hidden (B, H) -> the final norm's output (B, H): per layer,
        rms_norm | qkv | rope_attend (rotary, cache write, attention) | o | add_rms_norm | gate_up | silu_mul |
        down | add_rms_norm (the next layer's input norm, or the final one), the residual stream in place."""
        b = hidden.shape[0]
        cos, sin = (c.reshape(b, -1) for c in self.rotary(hidden[:, None], positions))
        where, norms = positions[:, 0].contiguous(), self.norms
        assert norms is not None
        alone = torch.arange(b, device=hidden.device)
        leader, shared, order = cache.groups or (alone, torch.zeros_like(alone), alone)
        x = ops.rms_norm(hidden, *norms[0])
        scale, lo = self.layers[0].self_attn.scaling, cache.lo
        for index, (qkv, o, gate_up, down) in enumerate(self.plan):
            keys, values = cache.buffers(index)
            out = ops.rope_attend(
                qkv(x), cos, sin, keys, values, where, lo, scale, self.groups, leader, shared, order
            )
            x = ops.add_rms_norm(hidden, o(out).contiguous(), *norms[2 * index + 1])
            x = ops.add_rms_norm(hidden, down(ops.silu_mul(gate_up(x))).contiguous(), *norms[2 * index + 2])
        return x


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
"""transformers' norms that compute y = w * bf16(x * rsqrt(mean(x^2) + eps)), as the kernels do."""


def _packed(layers: list, final, config) -> bool:
    """Whether every layer is the packed bf16 copy's (`engine.fuse`) with the kernels' norms, activation and
    sizes (multiples of 16), so that a one-token step can run `LlamaDecoder._step`."""
    if getattr(config, "hidden_act", None) != "silu" or config.hidden_size % 16:
        return False
    norms = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)] + [final]
    return all(
        hasattr(layer.self_attn, "qkv_proj")
        and hasattr(layer.mlp, "gate_up_proj")
        and layer.mlp.gate_up_proj.out_features % 32 == 0
        for layer in layers
    ) and all(type(m).__name__ in RMS_NORMS and m.weight.dtype == torch.bfloat16 for m in norms)


def _function(module) -> Callable[[Tensor], Tensor]:
    """A projection as a function of a contiguous x: a packed one's op called directly (`as_function`)."""
    return module.as_function() if hasattr(module, "as_function") else module


def _norms(layers: list, final) -> list[tuple[Tensor, float]]:
    """(weight, eps) of the norms in the order a step meets them: input, post-attention per layer, final."""
    modules = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    return [(m.weight.detach(), float(m.variance_epsilon)) for m in modules + [final]]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding, as transformers' `apply_rotary_pos_emb` computes it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
