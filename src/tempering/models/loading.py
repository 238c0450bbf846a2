"""Load any local Hugging Face causal-LM directory, or build the tiny default model from a config.

Both paths end in the same place: a `transformers` model and tokenizer that `save_pretrained` writes as a
standard directory, which `AutoModelForCausalLM.from_pretrained` reads back.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tempering.errors import ConfigError, ModelLoadError
from tempering.models.lora import adapter_base, is_adapter_dir, load_adapters, merge
from tempering.models.rotary import exact_rotary

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str, key: str = "run.device") -> str:
    """`auto` -> `cuda` when a CUDA device is present, else `cpu`; a named CUDA device must exist.
    Raises ConfigError naming `key` (before any work starts) rather than failing inside the first forward."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA device (is this a CPU build of torch?)"
            raise ConfigError(f"{key}={name} but this machine has {have}; use {key}=auto or cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}=mps but MPS is not available here; use {key}=auto or cpu")
    return name


COMPUTE = ("float32", "bfloat16", "auto")


def compute_dtype(name: str, device: str, key: str = "model.compute") -> torch.dtype:
    """The dtype the matmuls of sampling and of the update run in (the parameters stay in `model.dtype`):
    `float32`; `bfloat16` (the engine samples from a bf16 copy of the weights, the update runs under
    autocast); `auto` = bfloat16 where it is faster here, else float32. bfloat16 where it is slower (a CPU
    without AMX: ~20x) raises ConfigError naming `key`, before any work starts."""
    if name not in COMPUTE:
        raise ConfigError(f"{key}={name}: expected one of {', '.join(COMPUTE)}")
    if name == "float32":
        return torch.float32
    if bf16_fast(device):
        return torch.bfloat16
    if name == "auto":
        return torch.float32
    raise ConfigError(
        f"{key}=bfloat16 is slower than float32 on this {device} (a CPU needs AMX for fast bf16 "
        f"matmuls; without, ~20x slower); use {key}=float32 or auto"
    )


def mixed_precision(device: torch.device, dtype: torch.dtype):
    """Autocast to `dtype` (off for float32) around one forward pass - never around an optimizer step:
    autocast keeps the bf16 cast of each trainable weight until its outermost region ends, so a region
    spanning several minibatches would run the later ones with the weights from before the first step."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@functools.cache
def bf16_fast(device: str) -> bool:
    """Whether bf16 matmuls beat fp32 here: a CUDA device with bf16, or a CPU with AMX tiles (Linux flag
    `amx_bf16`; measured on one: 2.3x at 32 rows, 2.8x at 128). Other CPUs do bf16 ~20x slower. (A flag, not
    a timing: a shared machine's timings swing too far to decide on.)"""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    if device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def check_model_dir(path: str | Path) -> Path:
    """Fail early, with a message naming the path, if it is not a loadable causal-LM directory (or a LoRA
    adapter directory whose base is one)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path '{path}' does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' is a file; expected a Hugging Face model directory")
    if is_adapter_dir(path):
        check_model_dir(adapter_base(path))
        return path
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model path '{path}' has no config.json; is it a Hugging Face model directory?")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"model path '{path}': config.json cannot be read ({e})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"model path '{path}': model type '{config.model_type}' is not a causal LM")
    weights = [*path.glob("*.safetensors"), *path.glob("*.bin")]
    if not weights:
        raise ModelLoadError(f"model path '{path}' has no weights (*.safetensors or *.bin)")
    return path


def load_model(
    path: str | Path, *, dtype: str = "float32", device: str = "cpu", trainable_adapters: bool = False
) -> torch.nn.Module:
    """A model directory as a transformers model. An adapter directory is loaded onto its base: merged into
    a plain model, or as a peft model whose adapters train (`trainable_adapters`, resuming a LoRA run)."""
    path = check_model_dir(path)
    if is_adapter_dir(path):
        model = load_adapters(load_model(adapter_base(path), dtype=dtype), path, trainable=trainable_adapters)
        return (model if trainable_adapters else merge(model)).to(device)
    try:
        model = exact_rotary(AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]))
    except Exception as e:  # the library's errors vary by format (OSError, SafetensorError, ...)
        raise ModelLoadError(
            f"model path '{path}': weights cannot be loaded ({type(e).__name__}: {e})"
        ) from None
    return model.to(device)


def load_tokenizer(path: str | Path):
    path = Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model path '{path}': no usable tokenizer ({e})") from None
    if tokenizer.pad_token_id is None:  # many causal LMs ship without one; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tiny_model(
    tokenizer,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_length: int,
    seed: int,
) -> LlamaForCausalLM:
    """A randomly initialised Llama-style model sized for the tokenizer (weights tied to save parameters)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return exact_rotary(LlamaForCausalLM(config))


def save_model(model: torch.nn.Module, tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
