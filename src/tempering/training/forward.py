"""Forward passes of the trainer: per-token log-probs (and entropy) of responses given their prompts."""

from __future__ import annotations

import torch
from torch import Tensor


def response_logprobs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(response_t | prompt, response_<t) for every response token.

    prompt_ids (B, P) left-padded, response_ids (B, R) right-padded -> logprobs (B, R), entropy (B, R) or None.
    Logits are divided by the sampling temperature, so these match the sampler's log-probs.
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)                       # (B, P + R)
    mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    r = response_ids.shape[1]
    # Logits at positions P-1 .. P+R-2 predict the R response tokens; keep only those (+1, then drop).
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=r + 1)
    logits = out.logits[:, :-1].float() / temperature                       # (B, R, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, response_ids[..., None]).squeeze(-1)      # (B, R)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)                       # (B, R)
    return logprobs, entropy
