"""LoRA adapters through `peft`: train low-rank adapters on a frozen base model.

An adapter directory (what a LoRA run's checkpoints hold) is peft's: `adapter_config.json` plus
`adapter_model.safetensors`, with `base_model_name_or_path` the absolute path of the base model. The KL
reference of a LoRA run is the same model with its adapters disabled (no second copy of the weights), and
`merge` folds the adapters into the base for export and evaluation: W' = W + (alpha / r) B A.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import torch

from tempering.errors import ModelLoadError

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> Path:
    """The base model directory an adapter was trained on (it must still be there)."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = Path(config.get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise ModelLoadError(f"adapter '{path}': its base model '{base}' is not a model directory")
    return base


def add_adapters(
    model: torch.nn.Module,
    base_dir: Path,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str] | str,
    seed: int = 0,
) -> torch.nn.Module:
    """Wrap `model` with fresh LoRA adapters (A random from `seed`, B zero); only they require gradients."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            with _peft_on_transformers_5():
                peft_model = get_peft_model(model, config)
    except ValueError as e:  # e.g. target modules that the architecture does not have
        raise ModelLoadError(f"model.lora: {e}") from None
    peft_model.peft_config["default"].base_model_name_or_path = str(Path(base_dir).resolve())
    return inputs_as_they_come(peft_model)


def load_adapters(model: torch.nn.Module, adapter_dir: Path, *, trainable: bool) -> torch.nn.Module:
    from peft import PeftModel

    with _peft_on_transformers_5():
        peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable)
    return inputs_as_they_come(peft_model)


@contextlib.contextmanager
def _peft_on_transformers_5():
    """peft asks a model for `is_gradient_checkpointing`, which transformers 5 renamed: one FutureWarning
    per wrapped model, about peft's code, not the caller's."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def inputs_as_they_come(model: torch.nn.Module) -> torch.nn.Module:
    """Adapters in their base layer's dtype take their input in the dtype it comes in. peft casts it to the
    adapter's dtype: under bf16 autocast a bf16 activation went to fp32 for the adapter, and autocast cast it
    straight back (two copies of every adapter's input, a sixth of a SmolLM2 update; the same values)."""
    for layer in model.modules():
        base = getattr(layer, "base_layer", None)
        adapters = getattr(layer, "lora_A", None)
        if (
            hasattr(layer, "cast_input_dtype_enabled")
            and base is not None
            and adapters
            and all(a.weight.dtype == base.weight.dtype for a in adapters.values())
        ):
            layer.cast_input_dtype_enabled = False
    return model


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def merge(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model with the adapters folded into its weights."""
    return model.merge_and_unload() if is_peft(model) else model


def merged_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A copy of `model` as a plain transformers model - its adapters folded in, `W + s B A` computed in the
    weights' own dtype as `merge` does - with every floating tensor in `dtype` (None: as they are): what
    `merge(copy.deepcopy(model)).to(dtype)` gives, bitwise, allocating only the copy's own tensors (no
    transient full-precision copy of the whole model). Adapters of another kind (DoRA, a LoRA bias, several
    active, modules to save) take that longer way."""
    import copy

    memo: dict[int, object] = {}
    base = model.get_base_model() if is_peft(model) else model
    inside: set[int] = set()  # the tensors of the adapted layers: the copy has their folded weights instead
    for layer in base.modules():
        if hasattr(layer, "lora_A"):
            memo[id(layer)] = _folded(layer, dtype)
            inside |= {id(t) for t in [*layer.parameters(), *layer.buffers()]}
        elif type(layer).__module__.startswith("peft"):
            memo[id(layer)] = None
    if any(folded is None for folded in memo.values()):
        return merge(copy.deepcopy(model)).to(dtype) if dtype else merge(copy.deepcopy(model))
    for tensor in [*base.parameters(), *base.buffers()]:
        if id(tensor) not in inside:
            memo[id(tensor)] = _cast_copy(tensor, dtype)
    return copy.deepcopy(base, memo)


def _folded(layer: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Linear | None:
    """A peft LoRA layer as a plain linear layer with its active adapter folded into the weight, in `dtype`;
    None for what this does not fold (not a linear base, DoRA or another variant, a LoRA bias, not exactly one
    adapter active, already merged)."""
    base, active = getattr(layer, "base_layer", None), list(getattr(layer, "active_adapters", []))
    if (
        type(base) is not torch.nn.Linear
        or len(active) != 1
        or getattr(layer, "merged", True)
        or getattr(layer, "lora_variant", {}).get(active[0])
        or getattr(layer, "lora_bias", {}).get(active[0])
        or active[0] not in layer.lora_A
    ):
        return None
    folded = torch.nn.Linear(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
    with torch.no_grad():
        weight = base.weight + layer.get_delta_weight(active[0])  # a new tensor: cast, not copied again
    folded.weight = torch.nn.Parameter(weight.to(dtype) if dtype else weight, requires_grad=False)
    if base.bias is not None:
        folded.bias = _cast_copy(base.bias, dtype)
    return folded


def _cast_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` copied, in `dtype` if it is floating (as `Module.to(dtype)` casts); a parameter stays one."""
    data = tensor.detach()
    data = data.to(dtype, copy=True) if dtype is not None and data.is_floating_point() else data.clone()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The entries of `model.state_dict()` a checkpoint needs: the adapters only, for a peft model."""
    state = model.state_dict()
    if not is_peft(model):
        return state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable or "lora_" in k}
