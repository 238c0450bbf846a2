"""Forward passes of the trainer: per-token log-probs (and entropy) of responses given their prompts.

Packed by prompt. A GRPO batch holds each prompt `group_size` times; the rows that share a prompt become
one sequence - the prompt once, then each response - with a block mask (a response attends to the prompt
and to its own earlier tokens, never to another response) and positions that restart after the prompt
for each response. So the prompt is computed once per group, no row is padded to another's length but
its group's, and nothing is cached: gradient checkpointing works as it does for any sequence. The
gradients are those of the plain per-row pass (tested), since every response sees exactly its own
context.

Memory linear in length: the decoder's last hidden states are kept, and the output head, the log-softmax
and the entropy run on chunks of tokens (`chunk_tokens`), recomputed in the backward pass rather than stored -
the whole batch's full-vocabulary logits (16 rows x 1,000 tokens x 49,152 for SmolLM2: 3 GB per copy) never
exist at once. They are one autograd node (`HeadLogprobs`) with its gradient written out: autograd through
the dozen full-vocabulary elementwise operations took twice as long (measured: 1.33 vs 0.70 s for 1,040
SmolLM2 tokens, forward and backward, bf16).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CHUNK = 256
"""Most tokens whose logits exist at once (in the forward and, recomputed, in the backward pass)."""

LOGITS = 1 << 23
"""Fewer logits than this in a chunk: 32 MiB in fp32. SmolLM2's 49k vocabulary: 128 tokens a chunk, not
256 (measured: forward and backward of 1,090 tokens 0.80 -> 0.54 s, together with the scaling in place)."""


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk for a head of `vocab` outputs: a power of two, at most `CHUNK`, within `LOGITS`."""
    return max(1, min(CHUNK, 1 << max(0, ((LOGITS - 1) // max(1, vocab)).bit_length() - 1)))


def distinct_rows(ids: Tensor) -> tuple[Tensor, Tensor]:
    """ids (B, P) -> (index of one representative per distinct row (U,), inverse (B,) into it)."""
    _, inverse = torch.unique(ids, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), ids.shape[0], dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(ids.shape[0], device=ids.device), reduce="amin")
    return first, inverse


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def on_device(model, *tensors: Tensor) -> tuple[Tensor, ...]:
    """`tensors` moved to the model's device (no copy when they are there already)."""
    device = model_device(model)
    return tuple(t.to(device) for t in tensors)


def decoder_and_head(model):
    """(the decoder that gives the last hidden states, the output head) of a causal LM (peft: its base,
    LoRA layers in place); a backbone without a head (a critic's) is its own decoder."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        return base, None
    return base.get_decoder(), head


def response_logprobs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_attention: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(response_t | prompt, response_<t) for every response token.

    prompt_ids (B, P) left-padded, response_ids (B, R) right-padded -> logprobs (B, R), entropy (B, R) or None.
    `response_attention` (B, R) marks the tokens present (in a multi-turn episode also the observations,
    which the loss then masks out). Logits are divided by the sampling temperature, so these match the
    sampler's log-probs. Inputs may live anywhere; outputs are on the model's device.
    """
    decoder, head = decoder_and_head(model)
    hidden = response_hidden_states(
        decoder, prompt_ids, prompt_mask, response_ids, response_attention
    )  # (B, R, H)
    b, r = response_ids.shape
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    flat = hidden.reshape(b * r, -1)
    targets = response_ids.to(flat.device).reshape(-1)
    if type(head) is torch.nn.Linear:
        dtype = (
            torch.get_autocast_dtype(flat.device.type)
            if torch.is_autocast_enabled(flat.device.type)
            else None
        )
        logprobs, entropy = HeadLogprobs.apply(
            flat, head.weight, head.bias, targets, temperature, cap, dtype, with_entropy
        )
    else:  # a head of its own kind (LoRA on the head): autograd through chunks, each recomputed in the backward
        n = chunk_tokens(getattr(head, "out_features", 1))
        parts = [
            _chunk(head, flat[i : i + n], targets[i : i + n], temperature, cap) for i in range(0, b * r, n)
        ]
        logprobs = torch.cat([p[0] for p in parts]) if parts else flat.new_zeros(0)
        entropy = torch.cat([p[1] for p in parts]) if parts else flat.new_zeros(0)
    return logprobs.reshape(b, r), entropy.reshape(b, r) if with_entropy else None


class HeadLogprobs(torch.autograd.Function):
    """The output head, the log-softmax and the entropy of N tokens, `chunk_tokens` at a time, as one autograd
    node: what the backward pass needs is recomputed from the hidden states (one matmul and one softmax per
    chunk) rather than stored, and its gradient is written out - d logp/dz = onehot - p, dH/dz = -p (z - lse +
    H) for z = logits / T - instead of differentiating a dozen full-vocabulary elementwise operations. The
    log-probs are those of the plain head, log-softmax and gather (bitwise: the same operations in the same
    order); `dtype` is the autocast dtype the head's matmul runs in (None: the weights' own). Without
    `with_entropy` the entropy is zeros.

    The chunks' full-vocabulary tensors live in buffers allocated once per pass (`_Chunks`), every operation
    writing into them: a fresh 25 MB tensor per operation and chunk was page-faulted in anew each time (large
    blocks are mapped afresh: `runtime.fixed_mmap_threshold`), which cost SmolLM2's head more than its
    arithmetic."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, cap, dtype, with_entropy):
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.cap, ctx.dtype = temperature, cap, dtype
        ctx.chunk = n = chunk_tokens(weight.shape[0])
        ctx.w, ctx.b = w, b = _cast(weight, dtype), _cast(bias, dtype)  # cast once (SmolLM2's: 56 MB, 0.1 s)
        logprobs, lse = (hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(2))
        entropy = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        chunks = _Chunks(min(n, hidden.shape[0]), w)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], n):
                j = slice(i, i + n)
                z = chunks.logits(_cast(hidden[j], dtype), w, b, temperature, cap)
                chunks.logsumexp(z, out=lse[j])
                logprobs[j] = z.gather(-1, targets[j, None]).squeeze(-1) - lse[j]
                if with_entropy:  # H = lse - E_p[z]
                    p = chunks.softmax(z)
                    entropy[j] = lse[j] - torch.bmm(p[:, None], z[:, :, None]).flatten()
        ctx.lse_minus_entropy = lse - entropy  # (not the output itself: no reference cycle)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, cap, dtype, w, b = ctx.temperature, ctx.cap, ctx.dtype, ctx.w, ctx.b
        ctx.w = ctx.b = None
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        g_lp = grad_logprobs / temperature  # d/dlogits = d/dz / T
        g_h = None if grad_entropy is None or not grad_entropy.any() else grad_entropy / temperature
        chunks = _Chunks(min(ctx.chunk, hidden.shape[0]), w)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, hidden.shape[0], ctx.chunk):
                j = slice(i, i + ctx.chunk)
                h = _cast(hidden[j], dtype)
                z = chunks.logits(h, w, b, temperature, cap)
                p = chunks.softmax(z)
                if g_h is None:
                    grad = p.mul_(-g_lp[j, None])
                else:  # -p (g_lp + g_H (z - lse + H))
                    shift = g_lp[j] - g_h[j] * ctx.lse_minus_entropy[j]
                    grad = p.mul_(torch.addcmul(shift[:, None], z, g_h[j, None], out=chunks.spare(z))).neg_()
                grad.scatter_add_(-1, targets[j, None], g_lp[j, None])
                if cap:  # z = tanh(l / cap) cap / T: dz/dl = (1 - tanh^2) / T (the 1 / T is in g_lp, g_h)
                    grad.mul_(torch.mul(z, temperature / cap, out=chunks.spare(z)).square_().neg_().add_(1))
                grad = chunks.cast(grad)
                if grad_hidden is not None:
                    grad_hidden[j] = grad @ w
                if grad_weight is not None:
                    grad_weight += (grad.T @ h).to(weight.dtype)
                if grad_bias is not None:
                    grad_bias += grad.sum(0).to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


class _Chunks:
    """Buffers for a chunk's full-vocabulary tensors (at most `rows` x the head's outputs), reused chunk after
    chunk: the matmul's output in the head's dtype, z in fp32, and one or two more in fp32."""

    def __init__(self, rows: int, weight: Tensor):
        self.shape, self.dtype, self.device = (rows, weight.shape[0]), weight.dtype, weight.device
        self.out = torch.empty(self.shape, dtype=weight.dtype, device=weight.device)
        self.z = self.out if weight.dtype == torch.float32 else self._fp32()
        self.p, self._spare = self._fp32(), None

    def _fp32(self) -> Tensor:
        return torch.empty(self.shape, dtype=torch.float32, device=self.device)

    def logits(
        self, hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, cap: float | None
    ) -> Tensor:
        """z = head(hidden) / T (soft-capped first), in fp32, as `_scaled` computes it, in the buffers."""
        k = hidden.shape[0]
        out = self.out[:k]  # as `linear` computes it: addmm with a bias, mm without
        out = (
            torch.mm(hidden, weight.T, out=out)
            if bias is None
            else torch.addmm(bias, hidden, weight.T, out=out)
        )
        z = self.z[:k]
        return _scale_(z if z is out else z.copy_(out), temperature, cap)

    def logsumexp(self, z: Tensor, *, out: Tensor) -> Tensor:
        """`torch.logsumexp(z, -1)` (the same operations in its order: bitwise), its temporary in a buffer."""
        top = z.amax(-1, keepdim=True)
        top.masked_fill_(top.abs() == float("inf"), 0)
        torch.sum(torch.sub(z, top, out=self.p[: z.shape[0]]).exp_(), -1, out=out)
        return out.log_().add_(top.squeeze(-1))

    def softmax(self, z: Tensor) -> Tensor:
        return torch.ops.aten._softmax.out(z, -1, False, out=self.p[: z.shape[0]])

    def spare(self, z: Tensor) -> Tensor:
        self._spare = self._fp32() if self._spare is None else self._spare
        return self._spare[: z.shape[0]]

    def cast(self, grad: Tensor) -> Tensor:
        """`grad` in the head's dtype, into the matmul's buffer (free again by now)."""
        return grad if grad.dtype == self.dtype else self.out[: grad.shape[0]].copy_(grad)


def _cast(x: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    return x if x is None or dtype is None else x.to(dtype)


def _scaled(logits: Tensor, temperature: float, cap: float | None) -> Tensor:
    """z = logits / T (soft-capped first where the model caps them), in fp32: (N, V). Without autograd, in
    place on `logits` (a fresh matmul output) or its fp32 copy: one (N, V) tensor, not three."""
    logits = logits.float()
    if not torch.is_grad_enabled():
        return _scale_(logits, temperature, cap)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits / temperature


def _scale_(logits: Tensor, temperature: float, cap: float | None) -> Tensor:
    """`_scaled` in place on fp32 `logits`."""
    if cap:
        logits.div_(cap).tanh_().mul_(cap)
    return logits.div_(temperature) if temperature != 1.0 else logits


def _chunk(
    head, hidden: Tensor, targets: Tensor, temperature: float, cap: float | None
) -> tuple[Tensor, Tensor]:
    if torch.is_grad_enabled() and hidden.requires_grad:  # recomputed in the backward pass, not stored
        return checkpoint(_chunk_logprobs, head, hidden, targets, temperature, cap, use_reentrant=False)
    return _chunk_logprobs(head, hidden, targets, temperature, cap)


def _chunk_logprobs(
    head, hidden: Tensor, targets: Tensor, temperature: float, cap: float | None
) -> tuple[Tensor, Tensor]:
    """hidden (N, H), targets (N,) -> (log-prob of each target (N,), entropy (N,))."""
    logits = _scaled(head(hidden), temperature, cap)  # (N, V)
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    return logprobs, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # H = logsumexp - E[logit]


def response_hidden_states(
    decoder, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_attention: Tensor
) -> Tensor:
    """Last hidden state of a decoder (`get_decoder()`, or a critic's `AutoModel` backbone) at the R
    positions that predict the response tokens - the state before each token, which the output head or a
    value head reads. Rows that share a prompt run as one packed sequence while it stays within `PACK`
    tokens (its block mask is quadratic in length), packed sequences of similar lengths in one forward
    (`_similar_lengths`); a longer group's rows run one by one, plainly causal (attention memory linear in
    length). (B, R, H)"""
    prompt_ids, prompt_mask, response_ids, response_attention = on_device(
        decoder, prompt_ids, prompt_mask, response_ids, response_attention
    )
    b, r = response_ids.shape
    first, inverse = distinct_rows(prompt_ids)
    p_lens = prompt_mask.sum(1).tolist()
    r_lens = response_attention.sum(1).long().tolist()
    packed, sizes, alone = [], [], []
    for g in range(len(first)):
        rows = (inverse == g).nonzero().squeeze(1).tolist()
        p = p_lens[int(first[g])]
        size = p + sum(r_lens[i] for i in rows)  # the packed sequence's tokens
        if size <= PACK:
            packed.append((p, rows))
            sizes.append(size)
        else:
            alone.extend(rows)
    out = None
    for part in _similar_lengths(packed, sizes):
        for rows, hidden, where in _packed(decoder, prompt_ids, response_ids, part, r_lens):
            out = hidden.new_zeros(b, r, hidden.shape[-1]) if out is None else out
            for i, index in zip(rows, where):
                out[i, : len(index)] = hidden[index]
    for i in alone:
        p, n = p_lens[i], r_lens[i]
        ids = torch.cat([prompt_ids[i, prompt_ids.shape[1] - p :], response_ids[i, :n]])[None]
        hidden = decoder(input_ids=ids).last_hidden_state[0]  # (P + n, H), plainly causal
        out = hidden.new_zeros(b, r, hidden.shape[-1]) if out is None else out
        out[i, :n] = hidden[p - 1 : p - 1 + n]
    return out


PACK = 4096
"""Longest packed sequence (prompt + its group's responses), in tokens."""

SLACK = 0.1
"""Padding a forward over several packed groups may add, as a fraction of their tokens."""


def _similar_lengths(
    groups: list[tuple[int, list[int]]], sizes: list[int]
) -> list[list[tuple[int, list[int]]]]:
    """The packed groups (of `sizes` tokens) in forwards of similar lengths: longest first, a forward takes the
    next group while padding every group to the forward's longest stays within `SLACK` of their tokens (one
    forward over groups of 1,225 and 788 tokens would compute 437 padding tokens through every layer)."""
    parts, widths, tokens = [], [], []
    for g in sorted(range(len(groups)), key=lambda g: -sizes[g]):
        if parts and (len(parts[-1]) + 1) * widths[-1] <= (1 + SLACK) * (tokens[-1] + sizes[g]):
            parts[-1].append(groups[g])
            tokens[-1] += sizes[g]
        else:
            parts.append([groups[g]])
            widths.append(sizes[g])
            tokens.append(sizes[g])
    return parts


def _packed(
    decoder, prompt_ids: Tensor, response_ids: Tensor, groups: list[tuple[int, list[int]]], r_lens: list[int]
):
    """One forward over the groups, each a packed row: yields (its rows, the row's hidden states (L, H),
    for each of its rows the indices of the states that predict its tokens)."""
    width = max(p + sum(r_lens[i] for i in rows) for p, rows in groups)
    seqs, pos, owner, wheres = [], [], [], []
    for p, rows in groups:
        ids = prompt_ids[rows[0], prompt_ids.shape[1] - p :].tolist()
        positions, segment, where = list(range(p)), [-1] * p, []
        for i in rows:
            n, start = r_lens[i], len(ids)
            ids += response_ids[i, :n].tolist()
            positions += range(p, p + n)
            segment += [i] * n
            where.append([p - 1, *range(start, start + n - 1)][:n])  # the state before each token
        pad = width - len(ids)
        seqs.append(ids + [0] * pad)
        pos.append(positions + [0] * pad)
        owner.append(segment + [-2] * pad)
        wheres.append(where)
    device = prompt_ids.device
    ids, positions, seg = (torch.tensor(x, device=device) for x in (seqs, pos, owner))  # (G, L)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    visible = (seg[:, None, :] == -1) | (
        seg[:, None, :] == seg[:, :, None]
    )  # the prompt, or its own response
    real = (seg[:, None, :] != -2) & (seg[:, :, None] != -2)
    mask = (causal[None] & visible & real) | torch.eye(width, dtype=torch.bool, device=device)[
        None
    ]  # (G, L, L)
    hidden = decoder(input_ids=ids, attention_mask=mask[:, None], position_ids=positions).last_hidden_state
    for (_, rows), h, where in zip(groups, hidden, wheres):
        yield rows, h, [torch.tensor(w, dtype=torch.long, device=device) for w in where]
