"""Tiny random-weight models of real architectures, each with its family's tokens and chat template.

No model hub here: each model is built from its transformers config class at a few thousand parameters,
with a BPE vocabulary trained on task text plus the family's special tokens, and the family's chat template
(the format the released instruct models use; shortened to user/assistant turns, no system or tool branch).
Saved with `save_pretrained`, so the trainer loads it as it would a downloaded model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from tempering.models.tokenizer import train_tokenizer

CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
GEMMA = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


@dataclass
class Family:
    config: type
    bos: str | None
    eos: str
    pad: str
    template: str | None
    end_of_turn: str
    """The token the template writes after an assistant message (the model must learn to stop on it)."""
    extra: list[str] = field(default_factory=list)
    generation_eos: list[str] | None = None
    """`generation_config.eos_token_id` as the released model has it (None: the tokenizer's EOS)."""
    config_kw: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "llama": Family(
        LlamaConfig,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|finetune_right_pad_id|>",
        LLAMA3,
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        generation_eos=["<|end_of_text|>", "<|eot_id|>"],
    ),
    "qwen2": Family(Qwen2Config, None, "<|im_end|>", "<|endoftext|>", CHATML, "<|im_end|>", ["<|im_start|>"]),
    "qwen3": Family(
        Qwen3Config,
        None,
        "<|endoftext|>",
        "<|endoftext|>",
        CHATML,
        "<|im_end|>",
        ["<|im_start|>", "<|im_end|>"],
        generation_eos=["<|im_end|>", "<|endoftext|>"],
        config_kw={"head_dim": 16},
    ),
    "mistral": Family(MistralConfig, "<s>", "</s>", "<unk>", MISTRAL, "</s>", ["[INST]", "[/INST]"]),
    "gemma": Family(
        GemmaConfig,
        "<bos>",
        "<eos>",
        "<pad>",
        GEMMA,
        "<end_of_turn>",
        ["<start_of_turn>", "<end_of_turn>"],
        generation_eos=["<eos>", "<end_of_turn>"],
        config_kw={"head_dim": 16},
    ),
    "gpt2": Family(GPT2Config, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>", None, "<|endoftext|>"),
}

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "Write a function that returns the sum of a list.",
    "def first(xs):\n    return xs[0]\n",
    "Traceback (most recent call last): AssertionError",
    "tests passed: 3/4. add(1, 2) returned 4, expected 3",
    "The answer is 42.",
]


def build(name: str, path: Path, texts: list[str] = TEXT, vocab_size: int = 320) -> Path:
    """A tiny `name` model and tokenizer saved to `path` (a standard Hugging Face directory)."""
    fam = FAMILIES[name]
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    specials = [t for t in dict.fromkeys([fam.bos, fam.eos, fam.pad, *fam.extra]) if t]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = fam.bos, fam.eos, fam.pad
    tokenizer.chat_template = fam.template
    ids = tokenizer.convert_tokens_to_ids
    size = dict(
        vocab_size=len(tokenizer),
        bos_token_id=ids(fam.bos) if fam.bos else None,
        eos_token_id=ids(fam.eos),
        pad_token_id=ids(fam.pad),
    )
    if fam.config is GPT2Config:
        config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=512, **size)
    else:
        config = fam.config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            **size,
            **fam.config_kw,
        )
    model = AutoModelForCausalLM.from_config(config)
    if fam.generation_eos:
        model.generation_config.eos_token_id = [ids(t) for t in fam.generation_eos]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
