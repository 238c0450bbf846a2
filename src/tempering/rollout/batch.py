"""The tensor batch the trainer consumes (verl / TRL vocabulary), and the `Rollout` that carries it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

from tempering.inference.generation import left_pad
from tempering.types import Episode, RewardResult


@dataclass
class RolloutBatch:
    prompt_ids: Tensor  # (B, P) left-padded
    prompt_mask: Tensor  # (B, P)
    response_ids: Tensor  # (B, R) right-padded
    response_mask: Tensor  # (B, R) float: 1.0 on tokens the policy generated (trained on)
    old_logprobs: Tensor  # (B, R) pi_old: the sampler's log-probs (or the trainer's recompute)
    rewards: Tensor  # (B,) sequence rewards
    group_ids: Tensor  # (B,) samples of the same task share an id
    advantages: Tensor | None = None  # (B, R)
    returns: Tensor | None = None  # (B, R)
    ref_logprobs: Tensor | None = None  # (B, R) under the frozen reference, when KL is used
    values: Tensor | None = None  # (B, R) critic values, when a critic is used
    token_rewards: Tensor | None = None  # (B, R) per-token rewards (process steps, KL penalty), when used
    response_attention: Tensor | None = None
    """(B, R) 1 on every response token present: the policy's and, in multi-turn episodes, the observations'
    (which `response_mask` leaves out of the loss). None = `response_mask`."""
    versions: Tensor | None = None
    """(B,) the policy version (RL step) that sampled each row."""
    behaviour_logprobs: Tensor | None = None
    """(B, R) the sampler's log-probs, when the trainer recomputed `old_logprobs` (`algo.correction`)."""
    is_weights: Tensor | None = None
    """(B, R) the mismatch correction's truncated importance weights pi_old / mu (no gradient; `tis`)."""
    kept_mask: Tensor | None = None
    """(B, R) `response_mask` less the tokens the mismatch correction rejected (`mis`); None: none were."""

    @property
    def attention(self) -> Tensor:
        """(B, R) the response part of the attention mask."""
        return self.response_mask if self.response_attention is None else self.response_attention

    @property
    def loss_mask(self) -> Tensor:
        """(B, R) the tokens the update's losses average over: the policy's, less those rejected (verl's
        rejection sampling takes them out of its `response_mask`). Rollout metrics keep `response_mask`."""
        return self.response_mask if self.kept_mask is None else self.kept_mask

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def minibatches(self, n: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        """`n` minibatches of row indices over the groups in a random order, each group's rows together: a
        minibatch holds whole groups (all of them when the groups divide evenly), so the trainer's forward,
        which packs the rows that share a prompt, computes each prompt once per step - rows shuffled one by one
        put a piece of every group in every minibatch, and each computed the prompt again."""
        ids, group = torch.unique(self.group_ids, return_inverse=True)
        rank = torch.randperm(len(ids), generator=generator)[group]  # (B,) its group's place
        return torch.sort(rank, stable=True).indices.chunk(n)

    def select(self, index: Tensor) -> RolloutBatch:
        """Rows `index` of every tensor (a minibatch)."""
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: (v[index] if isinstance(v, Tensor) else v) for k, v in picked.items()})

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Every tensor on `device` (a no-op copy-free view when it is already there). The batch is built
        and kept on the CPU; the trainer moves each minibatch to the model's device."""
        return replace(
            self,
            **{f.name: v.to(device) for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)},
        )

    def trim(self) -> RolloutBatch:
        """Drop prompt columns that are padding in every row (left) and response columns likewise (right)."""
        p = int((self.prompt_mask.sum(0) > 0).long().argmax()) if self.prompt_mask.any() else 0
        r = int(self.response_mask.sum(0).nonzero().max()) + 1 if self.response_mask.any() else 0
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor) and v.dim() == 2:
                v = v[:, p:] if f.name.startswith("prompt") else v[:, :r]
            out[f.name] = v
        return replace(self, **out)

    def informative(self) -> RolloutBatch:
        """The rows whose advantage is non-zero somewhere (all rows if none is): a zero-advantage row adds
        nothing to the policy gradient, only cost, and weight in the token mean (DAPO drops such groups)."""
        assert self.advantages is not None, "compute advantages first"
        rows = (self.advantages != 0).any(1).nonzero().squeeze(1)  # (B',)
        return self.select(rows) if len(rows) else self

    def num_tokens(self) -> int:
        return int(self.prompt_mask.sum() + self.response_mask.sum())


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """Stack batches with different padding widths (prompts padded on the left, responses on the right)."""

    def cat(name: str, left: bool) -> Tensor | None:
        ts = [getattr(b, name) for b in batches]
        if all(t is None for t in ts):
            return None
        if any(t is None for t in ts):  # e.g. token rewards in some parts only: zeros where a part has none
            ts = [
                torch.zeros_like(b.response_mask, dtype=t0.dtype) if t is None else t
                for b, t in zip(batches, ts)
                for t0 in [next(x for x in ts if x is not None)]
            ]
        if ts[0].dim() == 1:
            return torch.cat(ts)
        width = max(t.shape[1] for t in ts)
        out = []
        for t in ts:
            fill = torch.zeros((t.shape[0], width - t.shape[1]), dtype=t.dtype)
            out.append(torch.cat([fill, t] if left else [t, fill], dim=1))
        return torch.cat(out)

    return RolloutBatch(**{f.name: cat(f.name, f.name.startswith("prompt")) for f in fields(RolloutBatch)})


def collate(
    episodes: list[Episode], rewards: list[RewardResult], tokenizer, group_offset: int = 0
) -> RolloutBatch:
    """Episodes -> a RolloutBatch: the outcome as the sequence reward, process rewards at the last token of
    the turn that earned them (a one-turn episode's line rewards at each line's last token), observation
    tokens attended to (`response_attention`) but not trained on."""
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], tokenizer.pad_token_id)
    width = max(1, max(len(e.ids) for e in episodes))
    b = len(episodes)
    response_ids = torch.full((b, width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((b, width))
    attention = torch.zeros((b, width))
    old_logprobs = torch.zeros((b, width))
    token_rewards = torch.zeros((b, width))
    for i, (e, r) in enumerate(zip(episodes, rewards)):
        n = len(e.ids)
        if n:
            response_ids[i, :n] = torch.tensor(e.ids)
            response_mask[i, :n] = torch.tensor(e.policy, dtype=torch.float32)
            attention[i, :n] = 1.0
            old_logprobs[i, :n] = torch.tensor(e.logprobs)
        for end, value in zip(e.turn_ends, r.info["turn_rewards"]):
            token_rewards[i, end] += value
        if r.info.get("step_rewards") and n:
            pieces = [tokenizer.decode([t]) for t in e.ids]
            for end, value in zip(line_end_tokens(pieces), r.info["step_rewards"]):
                token_rewards[i, end] += value
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        rewards=torch.tensor([r.info["outcome"] for r in rewards], dtype=torch.float32),
        group_ids=torch.tensor([e.group_id + group_offset for e in episodes]),
        token_rewards=token_rewards if token_rewards.any() else None,
        response_attention=attention,
        versions=torch.tensor([e.version for e in episodes]),
    )


def line_end_tokens(pieces: list[str]) -> list[int]:
    """For the tokens spelling a text: the index of the token that ends each of its lines (the last token
    ends the last line, newline or not) - the steps of `rewards.step_texts`."""
    ends = [i for i, piece in enumerate(pieces) for _ in range(piece.count("\n"))]
    if pieces and (not ends or ends[-1] != len(pieces) - 1):
        ends.append(len(pieces) - 1)
    return ends


@dataclass
class Rollout:
    """What `collect` returns: the scored episodes and the batch the trainer consumes."""

    episodes: list[Episode]
    rewards: list[RewardResult]
    batch: RolloutBatch
    metrics: dict[str, float] = field(default_factory=dict)
    """Counts for the step's row: guidance's guided groups, DAPO's dynamic-sampling counts."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of its phases (`timing_s/gen`, `timing_s/reward`), wherever it ran."""


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    """One rollout of several (a round's shards, DAPO's rounds): episodes and rows in order, counts and
    times summed."""

    def total(name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in parts:
            for k, v in getattr(p, name).items():
                out[k] = out.get(k, 0.0) + v
        return out

    return Rollout(
        [e for p in parts for e in p.episodes],
        [x for p in parts for x in p.rewards],
        concat_batches([p.batch for p in parts]),
        total("metrics"),
        total("timings"),
    )
