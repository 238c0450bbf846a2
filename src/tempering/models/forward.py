"""Forward passes of the trainer: per-token log-probs (and entropy) of responses given their prompts.

A GRPO batch holds each prompt `group_size` times. The prompt is encoded once per distinct prompt and
its key/value cache is shared by the rows that repeat it, so the cost of a row is its response tokens
(measured on the default recipe: prompts ~70 tokens, responses ~15). Gradients flow through the shared
cache into the prompt's forward pass, so the result equals the plain full-sequence pass.
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def response_logprobs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_attention: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log pi(response_t | prompt, response_<t) for every response token.

    prompt_ids (B, P) left-padded, response_ids (B, R) right-padded -> logprobs (B, R), entropy (B, R) or None.
    `response_attention` (B, R) marks the tokens present (in a multi-turn episode also the observations,
    which the loss then masks out). Logits are divided by the sampling temperature, so these match the
    sampler's log-probs. Inputs may live anywhere; outputs are on the model's device.
    """
    prompt_ids, prompt_mask, response_ids, response_attention = on_device(
        model, prompt_ids, prompt_mask, response_ids, response_attention)
    r = response_ids.shape[1]
    first, inverse = distinct_rows(prompt_ids) if share_prompts else (None, None)
    if first is None or len(first) == len(prompt_ids) or r == 0:
        logits = _full_logits(model, prompt_ids, prompt_mask, response_ids, response_attention)
    else:
        logits = _shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_attention,
                                       first, inverse)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)          # (B, R, V)
    logprobs = logp_all.gather(-1, response_ids[..., None]).squeeze(-1)      # (B, R)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)                       # (B, R)
    return logprobs, entropy


def response_hidden_states(model, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                           response_attention: Tensor, *, share_prompts: bool = True) -> Tensor:
    """Last hidden state of a decoder backbone (`AutoModel`, no LM head) at the R positions that predict
    the response tokens - the state before each token, which is what a critic's value head reads. (B, R, H)"""
    prompt_ids, prompt_mask, response_ids, response_attention = on_device(
        model, prompt_ids, prompt_mask, response_ids, response_attention)
    first, inverse = distinct_rows(prompt_ids) if share_prompts else (None, None)
    if first is None or len(first) == len(prompt_ids) or response_ids.shape[1] == 0:
        return _full_logits(model, prompt_ids, prompt_mask, response_ids, response_attention, "last_hidden_state")
    return _shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_attention, first, inverse,
                                 "last_hidden_state")


def _full_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, field: str = "logits") -> Tensor:
    """One pass over prompt + response; the outputs at the R positions that predict the response (B, R, .)."""
    ids = torch.cat([prompt_ids, response_ids], dim=1)                       # (B, P + R)
    mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    r = response_ids.shape[1]
    # Positions P-1 .. P+R-2 predict the R response tokens; keep only those (+1, then drop).
    if field == "logits":
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=r + 1)
        return out.logits[:, :-1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    return getattr(out, field)[:, -(r + 1):-1]


def _shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, first, inverse,
                          field: str = "logits"):
    """Encode the U distinct prompts once, expand their cache to the B rows, then run the responses."""
    p_mask = prompt_mask.long()
    p_pos = (p_mask.cumsum(-1) - 1).clamp_min(0)
    keep = {"logits_to_keep": 1} if field == "logits" else {}
    out = model(input_ids=prompt_ids[first], attention_mask=p_mask[first], position_ids=p_pos[first],
                use_cache=True, **keep)
    cache = out.cache
    cache.batch_select_indices(inverse)                                      # (U, ...) -> (B, ...)
    head = getattr(out, field)[:, -1:][inverse]                              # (B, 1, .) predicts token 0
    mask = torch.cat([p_mask, response_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, prompt_ids.shape[1]:]  # (B, R)
    r = response_ids.shape[1]
    out = model(input_ids=response_ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                cache=cache, use_cache=True) if r > 1 else None
    return head if out is None else torch.cat([head, getattr(out, field)], dim=1)
