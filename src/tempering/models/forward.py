"""Forward passes of the trainer: per-token log-probs (and entropy) of responses given their prompts.

Packed by prompt. A GRPO batch holds each prompt `group_size` times; the rows that share a prompt become
one sequence - the prompt once, then each response - with a block mask (a response attends to the prompt
and to its own earlier tokens, never to another response) and positions that restart after the prompt
for each response. So the prompt is computed once per group, no row is padded to another's length but
its group's, and nothing is cached: gradient checkpointing works as it does for any sequence. The
gradients are those of the plain per-row pass (tested), since every response sees exactly its own
context.

Memory linear in length: the decoder's last hidden states are kept, and the output head, the log-softmax
and the entropy run on chunks of `CHUNK` tokens, each recomputed in the backward pass (checkpointed)
rather than stored - the whole batch's full-vocabulary logits (16 rows x 1,000 tokens x 49,152 for
SmolLM2: 3 GB per copy) never exist at once.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

CHUNK = 1024
"""Tokens whose logits exist at once (in the forward and, recomputed, in the backward pass)."""


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


def response_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                      response_attention: Tensor, *, temperature: float = 1.0,
                      with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log pi(response_t | prompt, response_<t) for every response token.

    prompt_ids (B, P) left-padded, response_ids (B, R) right-padded -> logprobs (B, R), entropy (B, R) or None.
    `response_attention` (B, R) marks the tokens present (in a multi-turn episode also the observations,
    which the loss then masks out). Logits are divided by the sampling temperature, so these match the
    sampler's log-probs. Inputs may live anywhere; outputs are on the model's device.
    """
    decoder, head = decoder_and_head(model)
    hidden = response_hidden_states(decoder, prompt_ids, prompt_mask, response_ids, response_attention)  # (B, R, H)
    b, r = response_ids.shape
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    flat = hidden.reshape(b * r, -1)
    targets = response_ids.to(flat.device).reshape(-1)
    parts = [_chunk(head, flat[i: i + CHUNK], targets[i: i + CHUNK], temperature, cap, with_entropy)
             for i in range(0, b * r, CHUNK)]
    logprobs = torch.cat([p[0] for p in parts]).reshape(b, r) if parts else flat.new_zeros(b, r)
    entropy = torch.cat([p[1] for p in parts]).reshape(b, r) if with_entropy and parts else None
    return logprobs, entropy


def _chunk(head, hidden: Tensor, targets: Tensor, temperature: float, cap: float | None,
           with_entropy: bool) -> tuple[Tensor, Tensor]:
    if torch.is_grad_enabled() and hidden.requires_grad:  # recomputed in the backward pass, not stored
        return checkpoint(_chunk_logprobs, head, hidden, targets, temperature, cap, with_entropy, use_reentrant=False)
    return _chunk_logprobs(head, hidden, targets, temperature, cap, with_entropy)


def _chunk_logprobs(head, hidden: Tensor, targets: Tensor, temperature: float, cap: float | None,
                    with_entropy: bool) -> tuple[Tensor, Tensor]:
    """hidden (N, H), targets (N,) -> (log-prob of each target (N,), entropy (N,) or zeros)."""
    logits = head(hidden).float()                                               # (N, V)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)                                       # (N,)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, torch.zeros_like(logprobs)
    return logprobs, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)     # H = logsumexp - E[logit]


def response_hidden_states(decoder, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                           response_attention: Tensor) -> Tensor:
    """Last hidden state of a decoder (`get_decoder()`, or a critic's `AutoModel` backbone) at the R
    positions that predict the response tokens - the state before each token, which the output head or a
    value head reads. Rows that share a prompt run as one packed sequence (module docstring). (B, R, H)"""
    prompt_ids, prompt_mask, response_ids, response_attention = on_device(
        decoder, prompt_ids, prompt_mask, response_ids, response_attention)
    b, r = response_ids.shape
    first, inverse = distinct_rows(prompt_ids)
    p_lens = prompt_mask.sum(1).tolist()
    r_lens = response_attention.sum(1).long().tolist()
    groups = [[i for i in range(b) if int(inverse[i]) == g] for g in range(len(first))]
    seqs, pos, owner, lengths = [], [], [], []   # per packed row: ids, positions, segment owner (-1 = prompt)
    where = torch.zeros((b, r), dtype=torch.long)  # flat index (row * L + position) predicting each token
    width = max(p_lens[int(first[g])] + sum(r_lens[i] for i in rows) for g, rows in enumerate(groups))
    for g, rows in enumerate(groups):
        p = p_lens[int(first[g])]
        ids = prompt_ids[int(first[g]), prompt_ids.shape[1] - p:].tolist()
        positions, segment = list(range(p)), [-1] * p
        for i in rows:
            n = r_lens[i]
            start = len(ids)
            ids += response_ids[i, :n].tolist()
            positions += list(range(p, p + n))
            segment += [i] * n
            # Token t is predicted by the state before it: the prompt's last token for t = 0.
            before = [p - 1] + list(range(start, start + n - 1))
            if n:
                where[i, :n] = torch.tensor(before, dtype=torch.long) + g * width
        lengths.append(len(ids))
        seqs.append(ids + [0] * (width - len(ids)))
        pos.append(positions + [0] * (width - len(ids)))
        owner.append(segment + [-2] * (width - len(ids)))
    device = prompt_ids.device
    ids = torch.tensor(seqs, device=device)                                     # (G, L)
    positions = torch.tensor(pos, device=device)
    seg = torch.tensor(owner, device=device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    visible = (seg[:, None, :] == -1) | (seg[:, None, :] == seg[:, :, None])    # prompt, or its own response
    mask = (causal[None] & visible & (seg[:, None, :] != -2) & (seg[:, :, None] != -2))[:, None]   # (G, 1, L, L)
    mask = mask | torch.eye(width, dtype=torch.bool, device=device)[None, None]  # padding attends to itself
    hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state  # (G, L, H)
    return hidden.reshape(len(groups) * width, -1)[where.to(device).reshape(-1)].reshape(b, r, -1)
