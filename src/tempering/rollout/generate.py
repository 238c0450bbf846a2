"""Batched sampling with a KV cache: token ids, sampling log-probs, masks, truncation.

A hand-written loop rather than `model.generate`, because RL needs the per-token log-probs of the
sampled tokens under the (temperature-scaled) policy, a seeded generator for exactly repeatable rollouts,
and the truncation flag; `generate` gives these only partially.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from tempering.models.forward import distinct_rows


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

    @property
    def finish_reasons(self) -> list[str]:
        """Per row, as OpenAI-compatible servers say it: `stop` (a stop token sampled) or `length` (budget
        reached)."""
        return ["length" if t else "stop" for t in self.truncated.tolist()]


@dataclass
class RowSampling:
    """Sampling settings of each row of a batch (a server's requests each bring their own); they replace
    the batch-wide temperature, top-p, greedy flag and generator of `generate`."""

    temperature: list[float]
    """Per row; 0 = greedy."""
    top_p: list[float]
    generators: list[torch.Generator]
    """One per row: a seeded request draws the same numbers whichever rows share its batch."""
    top_logprobs: int = 0
    """How many most likely tokens to report per step (`TokenStep.top`); 0 = none."""


@dataclass
class TokenStep:
    """What `generate`'s `on_step` hears each decode step, for the rows still generating."""

    rows: list[int]
    """Output row indices."""
    tokens: list[int]
    logprobs: list[float]
    """Each token's log-prob under the model's own distribution (temperature 1, no top-p): what an
    OpenAI-compatible server reports. (`Generation.logprobs` are under the sampling distribution.)"""
    top: list[list[tuple[int, float]]] | None = None
    """Per row, the `top_logprobs` most likely (token, log-prob), most likely first."""


def sample_rows(logits: Tensor, rows: RowSampling, index: list[int],
                generators: list[torch.Generator]) -> tuple[Tensor, Tensor, Tensor]:
    """logits (B, V) of output rows `index` -> (token (B,), its log-prob under the row's sampling
    distribution (B,), the raw log-softmax (B, V)). Each row draws from its own generator."""
    raw = torch.log_softmax(logits.float(), dim=-1)                                 # (B, V)
    temps = torch.tensor([rows.temperature[i] for i in index], device=logits.device)
    greedy = temps <= 0
    logp = torch.log_softmax(logits.float() / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    probs = logp.exp()
    top_p = torch.tensor([rows.top_p[i] for i in index], device=logits.device)
    if bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p[:, None]
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    token = torch.stack([probs[j].argmax() if greedy[j] else
                         torch.multinomial(probs[j], 1, generator=generators[j]).squeeze(0)
                         for j in range(len(index))])                               # (B,)
    return token, logp.gather(-1, token[:, None]).squeeze(-1), raw


def sample_next(logits: Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None,
                greedy: bool) -> tuple[Tensor, Tensor]:
    """logits (B, V) -> (token (B,), its log-prob (B,) under softmax(logits / temperature))."""
    if greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = logp.argmax(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)              # (B, V)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p                         # keep the smallest set >= top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)          # (B,)
    # The recorded log-prob is under the full tempered distribution (not the top-p truncation), which is
    # what the training forward pass recomputes; verl does the same.
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    stop_ids: tuple[int, ...] = (),
    rows: RowSampling | None = None,
    on_step: Callable[[TokenStep], Collection[int] | None] | None = None,
) -> Generation:
    """Sample one completion per prompt (repeat a prompt G times for a group). Prompts are token id lists.
    A completion ends at the first of `stop_ids` (default: EOS), which it keeps as its last token.
    `rows` gives each row its own sampling settings (a server's requests). `on_step`, when given, hears
    each step's new token of every row still generating (a server streams them, checks stop strings) and
    may return rows to end now: they leave the batch and the KV cache before the next decode step."""
    stops = torch.tensor(stop_ids or (tokenizer.eos_token_id,))
    if rows is not None or on_step is not None:
        batch_size = max(batch_size, len(prompts))  # row indices are the caller's: one chunk
    parts = [
        _generate_chunk(model, tokenizer, prompts[i: i + batch_size], max_new_tokens, temperature, top_p,
                        greedy, generator, stops, rows, on_step)
        for i in range(0, len(prompts), batch_size)
    ]
    return parts[0] if len(parts) == 1 else _concat(parts, tokenizer.pad_token_id)


def generator_on(device: torch.device, generator: torch.Generator | None) -> torch.Generator | None:
    """A generator that can draw on `device`: `generator` itself when it lives there, else a new one on the
    device seeded from it (so callers keep passing one CPU generator per purpose whatever the device, and a
    run stays repeatable; sampling on a GPU draws different numbers than on the CPU)."""
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def _generate_chunk(model, tokenizer, prompts, max_new_tokens, temperature, top_p, greedy, generator, stops,
                    rows=None, on_step=None):
    device = next(model.parameters()).device
    generator = generator_on(device, generator)
    row_generators = [generator_on(device, g) for g in rows.generators] if rows is not None else None
    pad = tokenizer.pad_token_id
    device_stops = stops.to(device)
    was_training = model.training
    model.eval()
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    # A group repeats its prompt: prefill each distinct prompt once and share its cache.
    first, inverse = distinct_rows(ids)
    out = model(input_ids=ids[first], attention_mask=mask[first], position_ids=positions[first],
                use_cache=True, logits_to_keep=1)
    cache, logits = out.cache, out.logits[inverse, -1]
    cache.batch_select_indices(inverse)
    b = len(prompts)
    tokens = torch.full((b, max_new_tokens), pad, dtype=torch.long)
    logps = torch.zeros((b, max_new_tokens))
    active = torch.arange(b)          # rows of the output that are still being generated
    width = 0
    for t in range(max_new_tokens):
        raw = None
        if rows is None:
            token, logp = sample_next(logits, temperature=temperature, top_p=top_p, generator=generator,
                                      greedy=greedy)
        else:
            index = active.tolist()
            token, logp, raw = sample_rows(logits, rows, index, [row_generators[i] for i in index])
        tokens[active, t], logps[active, t] = token.cpu(), logp.cpu()
        width = t + 1
        finished = torch.isin(token, device_stops)
        if on_step is not None:
            ended = on_step(_token_step(active, token, logp if raw is None else raw, rows))
            if ended:
                finished |= torch.isin(active, torch.tensor(sorted(ended), dtype=torch.long)).to(device)
        if bool(finished.all()) or t == max_new_tokens - 1:
            break
        if bool(finished.any()):
            # Drop finished rows from the batch and the KV cache: the remaining steps cost only what is
            # still being written (completions differ a lot in length).
            keep = (~finished).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            mask, positions, token, active = mask[keep], positions[keep], token[keep], active[keep.cpu()]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, cache=cache,
                    use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
    model.train(was_training)

    response_ids, logprobs = tokens[:, :width], logps[:, :width]                # (B, R)
    # A token is part of the response up to and including the first stop token.
    is_eos = torch.isin(response_ids, stops)
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    response_mask = (~after_eos).float()
    truncated = ~is_eos.any(1)
    texts = []
    for row, n, trunc in zip(response_ids.tolist(), response_mask.sum(1).long().tolist(), truncated.tolist()):
        texts.append(tokenizer.decode(row[: n if trunc else n - 1], skip_special_tokens=False))
    response_ids = response_ids.masked_fill(after_eos, pad)
    return Generation(prompt_ids, prompt_mask, response_ids, response_mask, logprobs * response_mask,
                      truncated, texts)


def _token_step(active: Tensor, token: Tensor, logp: Tensor, rows: RowSampling | None) -> TokenStep:
    """`logp`: the raw log-softmax (B, V) with per-row sampling, else the sampled tokens' log-probs (B,)."""
    if logp.dim() == 1:
        return TokenStep(active.tolist(), token.tolist(), logp.tolist())
    chosen = logp.gather(-1, token[:, None]).squeeze(-1)
    top = None
    if rows is not None and rows.top_logprobs > 0:
        values, ids = logp.topk(rows.top_logprobs, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return TokenStep(active.tolist(), token.tolist(), chosen.tolist(), top)


def _concat(parts: list[Generation], pad: int) -> Generation:
    def cat(tensors: list[Tensor], left: bool, value: float) -> Tensor:
        width = max(t.shape[1] for t in tensors)
        padded = []
        for t in tensors:
            fill = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
            padded.append(torch.cat([fill, t] if left else [t, fill], dim=1))
        return torch.cat(padded)

    return Generation(
        prompt_ids=cat([p.prompt_ids for p in parts], True, pad),
        prompt_mask=cat([p.prompt_mask for p in parts], True, 0),
        response_ids=cat([p.response_ids for p in parts], False, pad),
        response_mask=cat([p.response_mask for p in parts], False, 0.0),
        logprobs=cat([p.logprobs for p in parts], False, 0.0),
        truncated=torch.cat([p.truncated for p in parts]),
        texts=[t for p in parts for t in p.texts],
    )
