import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tempering.errors import ModelLoadError
from tempering.models.loading import check_model_dir, load_model, load_tokenizer


def test_round_trip_through_a_real_hf_directory(tiny_model_dir):
    # Loaded with plain transformers Auto classes, as any user would.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "def f(x: int) -> int:\n    return x + 1\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    ours = load_model(tiny_model_dir)
    batch = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(batch).logits, ours(batch).logits)


def test_saved_again_loads_identically(tiny_model_dir, tmp_path):
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    model.save_pretrained(tmp_path / "again")
    tokenizer.save_pretrained(tmp_path / "again")
    again = load_model(tmp_path / "again")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model path '.*nowhere' does not exist"):
        check_model_dir(tmp_path / "nowhere")


def test_directory_without_config_or_weights(tmp_path, tiny_model_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        check_model_dir(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no weights"):
        check_model_dir(tmp_path / "noweights")


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ModelLoadError, match="not a causal LM"):
        check_model_dir(tmp_path / "m")


def test_corrupt_weights(tmp_path, tiny_model_dir):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="weights cannot be loaded"):
        load_model(bad)
