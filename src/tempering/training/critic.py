"""The critic of PPO with GAE: a separate model (the policy's backbone, copied at the start of RL) with a
scalar value head, trained on the GAE returns with PPO's clipped value loss.

A separate critic (verl's and OpenRLHF's default) rather than a head on the policy: the value loss
then cannot disturb the policy's features, and the critic can have its own learning rate.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from tempering.algos.losses import clipped_value_loss
from tempering.models.forward import model_device, response_hidden_states
from tempering.models.loading import mixed_precision
from tempering.models.rotary import exact_rotary
from tempering.training.data_parallel import DataParallel, shares

HEAD_FILE = "value_head.pt"


class Critic(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # V = 0 at the start: advantages begin as plain returns
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_pretrained(cls, model_dir: Path, *, dtype: str = "float32", device: str = "cpu") -> Critic:
        """The backbone of any HF causal LM directory (its LM head is dropped); a saved head if present."""
        from transformers import AutoModel

        backbone = exact_rotary(AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype)))
        critic = cls(backbone).to(device)
        if (Path(model_dir) / HEAD_FILE).is_file():
            critic.head.load_state_dict(torch.load(Path(model_dir) / HEAD_FILE, map_location=device))
        return critic

    def save_pretrained(self, directory: Path) -> None:
        self.save_snapshot(directory, self.backbone.state_dict(), self.head.state_dict())

    def save_snapshot(self, directory: Path, backbone_state: dict, head_state: dict) -> None:
        """Write given (copied) states in this critic's format: an HF backbone directory plus the head."""
        self.backbone.save_pretrained(directory, state_dict=backbone_state, safe_serialization=True)
        torch.save(head_state, Path(directory) / HEAD_FILE)

    def values(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        response_ids: Tensor,
        response_mask: Tensor,
        response_attention: Tensor | None = None,
    ) -> Tensor:
        """V(s_t) before each policy token t (0 elsewhere). -> (B, R)"""
        attention = response_mask if response_attention is None else response_attention
        hidden = response_hidden_states(self.backbone, prompt_ids, prompt_mask, response_ids, attention)
        return self.head(hidden.float()).squeeze(-1) * response_mask.to(hidden.device)


def update_critic(
    critic: Critic,
    optimizer: torch.optim.Optimizer,
    batch,
    *,
    generator: torch.Generator,
    epochs: int = 1,
    minibatches: int = 1,
    clip_range: float = 0.2,
    max_grad_norm: float = 1.0,
    compute: torch.dtype = torch.float32,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """Regress V on the GAE returns: `epochs` x `minibatches` optimizer steps. -> mean metrics.
    `compute`: bfloat16 runs each minibatch's forward under autocast (`mixed_precision`).
    `dp`: this is one of M data-parallel ranks; it runs its part of each minibatch (`data_parallel`)."""
    assert batch.returns is not None and batch.values is not None
    critic.train()
    device = model_device(critic)
    params = [p for p in critic.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n, tok = 0, 1.0
    for _ in range(epochs):
        for index in batch.minibatches(minibatches, generator):
            if dp is not None:
                mine, counts = dp.part(index)
                tok, _ = shares(batch.loss_mask, index, mine, counts)  # the value loss is a token mean
                index = mine
            mb = batch.select(index).trim().to(device)
            with mixed_precision(device, compute):
                values = critic.values(
                    mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, mb.response_attention
                )
            loss, metrics = clipped_value_loss(
                values, mb.values, mb.returns, mb.loss_mask, clip_range=clip_range
            )
            loss = loss * tok
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if dp is not None:
                dp.allreduce_grads(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), max_grad_norm)
            optimizer.step()
            n += 1
            for k, v in {"vf_loss": loss.detach(), **{k: m * tok for k, m in metrics.items()}}.items():
                sums[f"critic/{k}"] = sums.get(f"critic/{k}", 0.0) + float(v)
            sums["critic/grad_norm"] = sums.get("critic/grad_norm", 0.0) + float(grad_norm)
    if dp is not None:
        sums = dp.allreduce_metrics(sums, keep=("critic/grad_norm",))
    return {k: v / n for k, v in sums.items()}
