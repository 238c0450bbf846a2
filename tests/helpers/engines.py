"""A rollout engine that plays a script: each context gets the next scripted action."""

from __future__ import annotations

import torch

from tempering.inference.engine import SamplingParams
from tempering.inference.generation import Generation, left_pad


class ScriptedEngine:
    """A rollout engine that answers each context with the next scripted action (plus EOS) and remembers
    every context it was shown."""

    def __init__(self, tokenizer, script, max_new_tokens=200):
        self.tokenizer, self.script = tokenizer, script  # script: (turn index, context text) -> action text
        self.sampling, self.version = SamplingParams(max_new_tokens=max_new_tokens), 0
        self.stop_ids = (tokenizer.eos_token_id,)
        self.contexts: list[list[list[int]]] = []

    def generate(self, prompts, *, max_new_tokens, **_):
        tokenizer = self.tokenizer
        self.contexts.append(prompts)
        turn = len(self.contexts) - 1
        rows = []
        for ids in prompts:
            text = self.script(turn, tokenizer.decode(ids))
            rows.append(
                tokenizer(text, add_special_tokens=False).input_ids[: max_new_tokens - 1]
                + [tokenizer.eos_token_id]
            )
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(rows), width))
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
        return Generation(
            prompt_ids,
            prompt_mask,
            ids,
            mask,
            -0.5 * mask,
            torch.zeros(len(rows), dtype=torch.bool),
            [tokenizer.decode(r[:-1]) for r in rows],
        )

    def release(self):
        pass
