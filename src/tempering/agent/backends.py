"""A local model as the deployment side's commands use it: its engine, tokenizer, chat format and context.

`load_local` takes anything `checkpoint.resolve_model` takes (a model, checkpoint or run directory, a
registry name) and builds the engine with `rollout.engine.make_engine`, as training does. `tempering
serve` renders each request's messages with the format the model was trained with (`rollout.chat`: its
tokenizer's template, or the plain format of the tiny model) and submits them to the engine; `tempering
repair` runs its episodes on it (or on an OpenAI-compatible URL: `make_engine(url, kind="http")`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tempering.rollout.protocol import RequestEngine, SamplingParams

if TYPE_CHECKING:
    import torch

Messages = list[dict[str, str]]


@dataclass
class LocalModel:
    name: str
    engine: RequestEngine
    """A `LocalEngine`, or any engine of the request protocol."""
    tokenizer: object
    format: object
    """The chat format (`rollout.chat.chat_format`)."""
    max_context: int
    """Prompt + completion budget in tokens."""

    def render(self, messages: Messages) -> list[int]:
        """Prompt ids of a conversation; ValueError when its roles do not fit the chat format."""
        return self.format.render(messages)


def local_model(model, tokenizer, *, name: str = "local", chat: str = "auto", max_context: int | None = None,
                dtype: torch.dtype | None = None, sampling: SamplingParams | None = None, max_rows: int = 256,
                on_step: Callable[[int], None] | None = None) -> LocalModel:
    from tempering.rollout.chat import chat_format
    from tempering.rollout.engine import make_engine

    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None) \
        or 1 << 30
    return LocalModel(name, make_engine(model, tokenizer, sampling or SamplingParams(), dtype=dtype,
                                              max_rows=max_rows, on_step=on_step), tokenizer,
                      chat_format(tokenizer, chat),
                      min(max_context or limit, limit))


def load_local(spec: str | Path, *, device: str = "auto", chat: str = "auto", max_context: int | None = None,
               sampling: SamplingParams | None = None, compute: str = "float32", max_rows: int = 256,
               on_step: Callable[[int], None] | None = None) -> LocalModel:
    """A local model from anything `checkpoint.resolve_model` takes: a model directory, a checkpoint or run
    directory (its newest model), or a registry name (`smollm2-135m-instruct`, prepared on first use)."""
    from tempering.checkpoint import resolve_model
    from tempering.models.loading import compute_dtype, load_model, load_tokenizer, resolve_device

    model_dir = resolve_model(spec)
    device = resolve_device(device, "--device")
    dtype = compute_dtype(compute, device, "--compute")
    model = load_model(model_dir, device=device)
    return local_model(model, load_tokenizer(model_dir), name=str(spec), chat=chat, max_context=max_context,
                       sampling=sampling, dtype=dtype, max_rows=max_rows, on_step=on_step)
