"""A local model as the deployment side's commands use it: its engine, tokenizer, chat format and context.

`load_local` takes anything `checkpoint.resolve_model` takes (a model, checkpoint or run directory, a
registry name) and opens it with `inference.engine.open_model`, as `eval` and the pipeline do. `tempering
serve` renders each request's messages with the format the model was trained with (`inference.chat`: its
tokenizer's template, or the plain format of the tiny model) and submits them to the engine; `tempering
repair` runs its episodes on it (or on an OpenAI-compatible URL: `make_engine(url, kind="http")`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tempering.inference.protocol import RequestEngine, SamplingParams

if TYPE_CHECKING:
    import torch

    from tempering.inference.engine import LocalEngine

Messages = list[dict[str, str]]


@dataclass
class LocalModel:
    name: str
    engine: RequestEngine
    """A `LocalEngine`, or any engine of the request protocol."""
    tokenizer: object
    format: object
    """The chat format (`inference.chat.chat_format`)."""
    max_context: int
    """Prompt + completion budget in tokens."""

    def render(self, messages: Messages) -> list[int]:
        """Prompt ids of a conversation; ValueError when its roles do not fit the chat format."""
        return self.format.render(messages)


def local_model(
    model,
    tokenizer,
    *,
    name: str = "local",
    chat: str = "auto",
    max_context: int | None = None,
    dtype: torch.dtype | None = None,
    sampling: SamplingParams | None = None,
    max_rows: int = 256,
    on_step: Callable[[int], None] | None = None,
) -> LocalModel:
    """A model already in memory, served (tests; `load_local` opens one from its directory)."""
    from tempering.inference.engine import make_engine

    engine = make_engine(
        model, tokenizer, sampling or SamplingParams(), dtype=dtype, max_rows=max_rows, on_step=on_step
    )
    return served(engine, name=name, chat=chat, max_context=max_context)


def served(engine: LocalEngine, *, name: str, chat: str, max_context: int | None) -> LocalModel:
    """`engine` with its chat format and context budget (at most the model's own positions)."""
    from tempering.inference.chat import chat_format

    config = engine.model.config
    limit = (
        getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 1 << 30
    )
    return LocalModel(
        name, engine, engine.tokenizer, chat_format(engine.tokenizer, chat), min(max_context or limit, limit)
    )


def load_local(
    spec: str | Path,
    *,
    device: str = "auto",
    chat: str = "auto",
    max_context: int | None = None,
    sampling: SamplingParams | None = None,
    compute: str = "float32",
    max_rows: int = 256,
    on_step: Callable[[int], None] | None = None,
) -> LocalModel:
    """A local model from anything `checkpoint.resolve_model` takes: a model directory, a checkpoint or run
    directory (its newest model), or a registry name (`smollm2-135m-instruct`, prepared on first use),
    opened by `inference.engine.open_model` as `eval` and the pipeline open theirs."""
    from tempering.checkpoint import resolve_model
    from tempering.inference.engine import open_model

    engine = open_model(
        resolve_model(spec),
        sampling or SamplingParams(),
        device=device,
        compute=compute,
        keys=("--device", "--compute"),
        max_rows=max_rows,
        on_step=on_step,
    )
    return served(engine, name=str(spec), chat=chat, max_context=max_context)
