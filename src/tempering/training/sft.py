"""Supervised warm-up on reference solutions: token-mean NLL of the completion given the prompt."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tempering.algos import masked_mean
from tempering.data.tasks import sft_completion
from tempering.inference.generation import encode_prompt, left_pad
from tempering.models.forward import response_logprobs
from tempering.training.optim import make_optimizer, make_scheduler
from tempering.types import Task


def encode_examples(tokenizer, tasks: list[Task]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) for every task with a reference solution."""
    eos = tokenizer.eos_token_id
    out = []
    for task in tasks:
        if task.reference_solution:
            completion = tokenizer(sft_completion(task), add_special_tokens=False).input_ids
            out.append((encode_prompt(tokenizer, task.prompt), completion + [eos]))
    return out


def length_grouped_batches(
    lengths: list[int], batch_size: int, generator: torch.Generator, group: int = 32
) -> list[list[int]]:
    """One epoch of batches of similar length (HF's LengthGroupedSampler idea): shuffle, cut into chunks of
    `group` batches, sort each chunk by length, split it into batches, shuffle the batches. Padding, the
    main waste on CPU, drops to nearly nothing while each batch stays a random draw."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    chunk = batch_size * group
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start : start + chunk], key=lambda i: lengths[i])
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


Transcript = list[tuple[str, "str | None", bool]]
"""A multi-turn SFT example after its prompt: (action, observation or None, train on this action?)."""


def encode_transcript(
    fmt, prompt: str, transcript: Transcript, tools: list[dict] | None = None
) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, ids after the prompt, loss mask over them) in the rollout's chat format: observations
    and the actions not marked for training are context only."""
    tokenizer = fmt.tokenizer
    prompt_ids, conv = fmt.start(prompt, tools)
    ids: list[int] = []
    mask: list[float] = []
    for action, observation, train in transcript:
        action_ids = tokenizer(action, add_special_tokens=False).input_ids + [fmt.end_id]
        ids += action_ids
        mask += [float(train)] * len(action_ids)
        if observation is not None:
            obs_ids = fmt.observation(conv, action, True, observation)
            ids += obs_ids
            mask += [0.0] * len(obs_ids)
    return prompt_ids, ids, mask


def collate_sft(examples: list[tuple], pad_id: int):
    """Examples (prompt ids, response ids[, loss mask]) -> prompt ids, prompt mask, response ids, response
    attention, loss mask."""
    prompt_ids, prompt_mask = left_pad([e[0] for e in examples], pad_id)
    width = max(len(e[1]) for e in examples)
    response_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width))
    loss_mask = torch.zeros((len(examples), width))
    for i, e in enumerate(examples):
        n = len(e[1])
        response_ids[i, :n] = torch.tensor(e[1])
        attention[i, :n] = 1.0
        loss_mask[i, :n] = torch.tensor(e[2]) if len(e) > 2 else 1.0
    return prompt_ids, prompt_mask, response_ids, attention, loss_mask


def run_sft(
    model,
    tokenizer,
    tasks: list[Task],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    schedule: str = "constant",
    weight_decay: float = 0.0,
    seed: int = 0,
    max_grad_norm: float = 1.0,
    on_step: Callable[[int, dict[str, float]], bool | None] | None = None,
    examples: list[tuple] | None = None,
) -> list[dict[str, float]]:
    """Train `steps` steps on length-grouped minibatches of reference completions (or of given `examples`,
    see `collate_sft`), or until `on_step` (called after each step with its metrics) returns True; returns
    per-step metrics."""
    examples = encode_examples(tokenizer, tasks) if examples is None else examples
    if not examples:
        raise ValueError("SFT needs tasks with a reference_solution; none of the training tasks has one")
    optimizer = make_optimizer(model, lr=lr, weight_decay=weight_decay)
    scheduler = make_scheduler(optimizer, warmup_steps=warmup_steps, total_steps=steps, schedule=schedule)
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    lengths = [len(e[0]) + len(e[1]) for e in examples]
    batches: list[list[int]] = []
    history = []
    model.train()
    for step in range(1, steps + 1):
        start = time.perf_counter()
        if not batches:
            batches = length_grouped_batches(lengths, batch_size, generator)
        index = batches.pop()
        tensors = [t.to(device) for t in collate_sft([examples[i] for i in index], tokenizer.pad_token_id)]
        logprobs, _ = response_logprobs(model, *tensors[:4])
        loss = -masked_mean(logprobs, tensors[4])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        row = {
            "step": step,
            "sft/loss": float(loss.detach()),
            "sft/grad_norm": float(grad_norm),
            "sft/lr": scheduler.get_last_lr()[0],
            "timing_s/step": time.perf_counter() - start,
        }
        history.append(row)
        if on_step and on_step(step, row):
            break
    return history
