"""Any local Hugging Face causal LM trains: SFT and two RL steps on tiny random-weight models of six
architectures, each with its family's chat template and stop tokens; the result reloads with
`from_pretrained`."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tempering.config import load_config
from tempering.data import generate_tasks
from tempering.data.tasks import sft_completion
from tempering.inference.chat import chat_format, end_of_turn, stop_token_ids
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.models.loading import load_model, load_tokenizer
from tempering.pipeline import train
from tests.helpers.architectures import FAMILIES, build

QUICK = [
    "sft.steps=4",
    "sft.batch_size=4",
    "train.steps=2",
    "data.num_train=40",
    "data.num_heldout=4",
    "eval.samples=1",
    "eval.every=0",
    "eval.val_tasks=4",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=12",
    "checkpoint.every=2",
    "tracking.tensorboard=false",
    "tracking.samples_every=0",
    "env.max_context=384",
]


@pytest.fixture(scope="module")
def corpus():
    train, _ = generate_tasks(60, 4, seed=3)
    return [t.prompt + sft_completion(t) for t in train]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_stop_tokens_come_from_the_template_and_the_generation_config(tmp_path, corpus, name):
    fam = FAMILIES[name]
    path = build(name, tmp_path / name, corpus)
    tokenizer, model = load_tokenizer(path), load_model(path)
    ids = tokenizer.convert_tokens_to_ids
    assert end_of_turn(tokenizer) == (fam.end_of_turn, ids(fam.end_of_turn))
    want = {ids(fam.eos), ids(fam.end_of_turn), *(ids(t) for t in fam.generation_eos or [])}
    assert set(stop_token_ids(tokenizer, model)) == want
    assert chat_format(tokenizer).name == ("plain" if fam.template is None else "template")


def prefers(model, token):
    """`model`, its logits favouring one token by a wide margin (a hook on its output head)."""

    def favour(module, inputs, logits):
        logits[..., token] += 100.0
        return logits

    model.get_output_embeddings().register_forward_hook(favour)
    return model


def test_generation_stops_at_the_end_of_turn_token(tmp_path, corpus):
    """Gemma ends a turn with `<end_of_turn>`, which is not its EOS: generation stops there and the action
    keeps it as its last token."""
    path = build("gemma", tmp_path / "gemma", corpus)
    tokenizer = load_tokenizer(path)
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end != tokenizer.eos_token_id
    engine = LocalEngine(prefers(load_model(path), end), tokenizer, SamplingParams(max_new_tokens=8))
    gen = engine.generate([chat_format(tokenizer).start("Write add.")[0]] * 2, greedy=True)
    assert gen.finish_reasons == ["stop", "stop"] and gen.response_ids[:, 0].tolist() == [end, end]
    assert gen.response_mask.sum(1).tolist() == [1.0, 1.0] and gen.texts == ["", ""]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_engines_fast_forward_gives_the_models_own_floats(tmp_path, corpus, name, monkeypatch):
    """The engine's Llama-family forward (`inference.decoder`) against the model's own: bitwise the same tokens
    and log-probs - prefill in chunks, a group's copies, decode, a next turn over a kept cache - in fp32 and
    from the engine's packed bf16 copy (q, k and v as one matmul there, gate and up as another). Other
    architectures run their own forward."""
    from tempering.inference.decoder import LlamaDecoder

    path = build(name, tmp_path / name, corpus)
    tokenizer = load_tokenizer(path)
    fmt = chat_format(tokenizer)
    prompts = [fmt.start(text)[0] for text in ("Write add.", "Return the first element of a list, please.")]
    contexts = [prompts[0]] * 3 + [prompts[1]]
    family = name in ("llama", "mistral", "qwen2", "qwen3")
    for dtype in (torch.float32, torch.bfloat16):
        runs = []
        for fast in (True, False):
            if not fast:
                monkeypatch.setattr(LlamaDecoder, "of", classmethod(lambda cls, model, attention: None))
            engine = LocalEngine(load_model(path), tokenizer, SamplingParams(max_new_tokens=10), dtype=dtype)
            engine.scheduler.prefill_chunk = 5
            first = engine.generate(contexts, generator=torch.Generator().manual_seed(1), keep=True)
            assert (engine.scheduler.fast is not None) == (fast and family)
            fused = dtype == torch.bfloat16 and name in ("llama", "mistral", "qwen2")
            assert fused == any(hasattr(m, "qkv_proj") for m in engine.scheduler.model.modules())
            assert (dtype == torch.bfloat16 and family) == any(
                hasattr(m, "gate_up_proj") for m in engine.scheduler.model.modules()
            )
            turn = [p + ids.tolist() + prompts[1][:4] for p, ids in zip(contexts, first.response_ids)]
            second = engine.generate(turn, generator=torch.Generator().manual_seed(2))
            assert all(second.reused)  # the next turn went through the kept caches
            runs.append([(g.response_ids, g.logprobs, g.response_mask) for g in (first, second)])
            monkeypatch.undo()
        for (ids, logprobs, mask), (ids0, logprobs0, mask0) in zip(*runs):
            assert torch.equal(ids, ids0) and torch.equal(mask, mask0)
            assert torch.equal(logprobs, logprobs0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_sft_and_two_rl_steps_then_the_saved_model_reloads(tmp_path, corpus, name):
    path = build(name, tmp_path / "start", corpus)
    run_dir = tmp_path / "run"
    summary = train(load_config("configs/smoke.yaml", [f"run.dir={run_dir}", f"model.path={path}", *QUICK]))
    assert summary["rl_steps"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["response_length/mean"] > 0 for r in rows)
    final = run_dir / "checkpoints" / "step_000002" / "model"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert type(model).__name__ == type(AutoModelForCausalLM.from_pretrained(path)).__name__
    assert tokenizer.chat_template == FAMILIES[name].template
    start = AutoModelForCausalLM.from_pretrained(path).state_dict()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert changed  # SFT and RL moved the weights


def test_the_vllm_and_the_local_engine_stop_on_the_same_ids(tmp_path, corpus):
    """The local engine reads the stop ids from the model object, the vLLM engine from the directory it
    loads: one function (`stop_token_ids`), the same ids - a generation_config id beyond EOS and the end of
    turn included (the vLLM engine used to take EOS and the end of turn only)."""
    path = build("llama", tmp_path / "llama", corpus)
    tokenizer, model = load_tokenizer(path), load_model(path)
    extra = tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, extra]
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    assert extra in stop_token_ids(tokenizer, model)
    assert stop_token_ids(tokenizer, tmp_path / "saved") == stop_token_ids(tokenizer, model)
