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
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids, mask


@dataclass
class Generation:
    prompt_ids: Tensor       # (B, P) left-padded
    prompt_mask: Tensor      # (B, P)
    response_ids: Tensor     # (B, R) right-padded; includes the EOS token when one was sampled
    response_mask: Tensor    # (B, R) float, 1.0 on generated tokens
    logprobs: Tensor         # (B, R) log-prob of each sampled token (temperature-scaled distribution)
    truncated: Tensor        # (B,) bool, True when no stop token came within max_new_tokens
    texts: list[str]         # decoded completions, the stop token and padding removed
    version: int = 0         # the policy version (RL step) whose weights sampled these
    reused: int = 0          # context tokens whose cache was kept from an earlier turn (not computed again)

    @property
    def finish_reasons(self) -> list[str]:
        """Per row, as OpenAI-compatible servers say it: `stop` (a stop token sampled) or `length` (budget
        reached)."""
        return ["length" if t else "stop" for t in self.truncated.tolist()]
