"""What every generation path shares: prompt encoding, left padding, and the batch result `Generation`.

The sampling itself is the engine's (`engine.py`, `scheduler.py`, `sampling.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt token ids: BOS (if the tokenizer has one) + the text. SFT and rollout both use this."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad id lists -> ids (B, P), mask (B, P)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
    return ids, mask


@dataclass
class Generation:
    prompt_ids: Tensor  # (B, P) left-padded
    prompt_mask: Tensor  # (B, P)
    response_ids: Tensor  # (B, R) right-padded; includes the EOS token when one was sampled
    response_mask: Tensor  # (B, R) float, 1.0 on generated tokens
    logprobs: Tensor  # (B, R) log-prob of each sampled token (temperature-scaled distribution)
    truncated: Tensor  # (B,) bool, True when no stop token came within max_new_tokens
    texts: list[str]  # decoded completions, the stop token and padding removed
    version: int = 0  # the policy version (RL step) whose weights sampled these
    reused: list[int] | None = None  # per row: context tokens whose cache came from an earlier turn or a
    # group's shared prompt (not computed again)

    @property
    def finish_reasons(self) -> list[str]:
        """Per row, as OpenAI-compatible servers say it: `stop` (a stop token sampled) or `length` (budget
        reached)."""
        return ["length" if t else "stop" for t in self.truncated.tolist()]


def generation_of(
    tokenizer,
    contexts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]] | None,
    stops: set[int],
    version: int,
    reused: list[int] | None = None,
) -> Generation:
    """A batch `Generation` from each context's sampled ids (a stop token last when one ended it)."""
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = left_pad(contexts, pad)
    width = max(map(len, responses), default=0)
    response_ids = torch.full((len(responses), width), pad, dtype=torch.long)
    response_mask = torch.zeros((len(responses), width))
    lp = torch.zeros((len(responses), width))
    for i, ids in enumerate(responses):
        response_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = 1.0
        if logprobs is not None:
            lp[i, : len(ids)] = torch.tensor(logprobs[i])
    ended = [bool(ids) and ids[-1] in stops for ids in responses]
    texts = [
        tokenizer.decode(ids[:-1] if e else ids, skip_special_tokens=False)
        for ids, e in zip(responses, ended)
    ]
    return Generation(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        lp,
        torch.tensor([not e for e in ended]),
        texts,
        version,
        reused,
    )
