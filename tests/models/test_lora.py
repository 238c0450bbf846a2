"""LoRA through peft: only the adapters train, checkpoints hold only them, the KL reference is the base with
the adapters disabled, and `tempering export` merges them into a plain model equal to base + adapter."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tempering.cli import main as cli
from tempering.config import build_config, load_config
from tempering.loop import RLTrainer
from tempering.models.loading import load_model
from tempering.pipeline import train
from tempering.roles import build_roles
from tempering.state import TrainState

LORA = [
    "model.lora.r=4",
    "model.lora.alpha=8",
    "sft.steps=0",
    "train.steps=2",
    "algo.lr=0.02",
    "algo.warmup_steps=0",
    "algo.kl_coef=0.05",
    "data.num_train=40",
    "data.num_heldout=4",
    "eval.samples=1",
    "eval.every=0",
    "eval.val_tasks=4",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=12",
    "tracking.tensorboard=false",
    "tracking.samples_every=0",
    # A reward that random completions vary on, so the untrained model gets a gradient.
    "reward.weights={tests: 1.0, 'tests.models.test_lora:digits': 1.0}",
]


def digits(task, traj) -> float:
    """The share of digits in the completion."""
    return sum(c.isdigit() for c in traj.completion) / max(1, len(traj.completion))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    train(load_config("configs/smoke.yaml", [f"run.dir={run_dir}", f"model.path={tiny_model_dir}", *LORA]))
    return run_dir


@pytest.mark.slow
def test_a_lora_run_changes_only_the_adapters(lora_run, tiny_model_dir):
    saved = lora_run / "checkpoints" / "step_000002" / "model"
    assert (saved / "adapter_config.json").is_file() and not (saved / "model.safetensors").exists()
    adapters = load_file(saved / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    assert any(
        k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items()
    )  # B starts at 0
    policy = load_model(saved, trainable_adapters=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, value in policy.state_dict().items():
        if "lora_" not in name:
            plain = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(value, base[plain]), name
    rows = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    assert all("actor/kl_loss" in r for r in rows) and rows[-1]["actor/kl_loss"] > 0


@pytest.mark.slow
def test_export_merges_the_adapters_into_the_base(lora_run, tiny_model_dir, tmp_path):
    out = tmp_path / "merged"
    assert cli(["export", str(lora_run), "--to", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    adapters = load_file(lora_run / "checkpoints" / "step_000002" / "model" / "adapter_model.safetensors")
    config = json.loads(
        (lora_run / "checkpoints" / "step_000002" / "model" / "adapter_config.json").read_text()
    )
    scale = config["lora_alpha"] / config["r"]
    worst, touched = 0.0, 0
    for key, weight in base.items():
        prefix = "base_model.model." + key.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in adapters:
            want = weight + scale * adapters[f"{prefix}.lora_B.weight"] @ adapters[f"{prefix}.lora_A.weight"]
            touched += 1
        else:
            want = weight
        worst = max(worst, float((merged[key] - want).abs().max()))
    assert touched >= 7 * 2  # all-linear: q, k, v, o, gate, up, down in each of the 2 layers
    assert worst < 1e-5, worst


def test_the_reference_of_a_lora_run_is_the_base_with_adapters_off(tiny_model_dir, tmp_path, tasks, sandbox):
    cfg = build_config(
        {},
        [
            "run.device=cpu",
            f"model.path={tiny_model_dir}",
            "model.lora.r=4",
            "algo.kl_coef=0.1",
            "rollout.max_new_tokens=8",
        ],
    )
    state = TrainState.build_or_resume(cfg, tmp_path, tasks[0][:8], tiny_model_dir, log=lambda *_: None)
    assert state.ref is None  # no second copy of the weights
    assert [n for n, p in state.policy.named_parameters() if p.requires_grad] and all(
        "lora_" in n for n, p in state.policy.named_parameters() if p.requires_grad
    )
    with torch.no_grad():
        for name, p in state.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the policy
    trainer = RLTrainer(cfg, state, [], build_roles(cfg, state, [], sandbox, log=lambda *_: None))
    gen = trainer.engine.generate([[1, 5, 9, 11]] * 2, generator=torch.Generator().manual_seed(0))
    args = gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask
    base = load_model(tiny_model_dir)
    from tempering.inference.engine import LocalEngine

    want = LocalEngine(base, state.tokenizer, trainer.engine.sampling).logprobs(*args)
    torch.testing.assert_close(trainer.ref.logprobs(*args), want)
    assert not torch.allclose(trainer.engine.logprobs(*args), want)


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]


@pytest.mark.slow
def test_a_lora_run_resumes_exactly(lora_run, tiny_model_dir, tmp_path):
    """Stopped after its first step's checkpoint, then continued: the adapters and the optimizer come back
    from the checkpoint, and the metrics equal those of the run that went straight through."""
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", f"model.path={tiny_model_dir}", *LORA, "checkpoint.every=1"]
    train(load_config("configs/smoke.yaml", [*args, "train.steps=1"]))
    train(load_config("configs/smoke.yaml", args))
    assert _rows(run_dir) == _rows(lora_run)


@pytest.mark.slow
def test_gradient_checkpointing_changes_memory_not_numbers(lora_run, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    train(
        load_config(
            "configs/smoke.yaml",
            [
                f"run.dir={run_dir}",
                f"model.path={tiny_model_dir}",
                *LORA,
                "model.gradient_checkpointing=true",
            ],
        )
    )
    for got, want in zip(_rows(run_dir), _rows(lora_run), strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_a_lora_run_continues_a_lora_run_then_resumes_exports_and_serves(lora_run, tmp_path):
    """The production loop: a LoRA run whose start model is another LoRA run (sft.steps 0). Its start is
    the other run's adapters merged once into RUN/start, recorded in start.json: its checkpoints load
    (evaluation after RL), it resumes, exports and serves - and its start stays put when the other run
    goes on."""
    from tests.helpers.servers import start, stop

    first = tmp_path / "first"
    shutil.copytree(lora_run, first)
    run_dir = tmp_path / "second"
    args = [f"run.dir={run_dir}", f"model.path={first}", *LORA]
    summary = train(load_config("configs/smoke.yaml", args))
    assert summary["rl_step_evaluated"] == 2
    record = json.loads((run_dir / "start.json").read_text())
    assert (
        Path(record["resolved"]) == (run_dir / "start").resolve()
        and (run_dir / "start" / "config.json").is_file()
    )
    adapters = json.loads(
        (run_dir / "checkpoints" / "step_000002" / "model" / "adapter_config.json").read_text()
    )
    assert adapters["base_model_name_or_path"] == record["resolved"]
    merged_first = load_model(first / "checkpoints" / "step_000002" / "model").state_dict()
    for key, value in AutoModelForCausalLM.from_pretrained(run_dir / "start").state_dict().items():
        torch.testing.assert_close(value, merged_first[key])

    # The first run goes on (a newer checkpoint); the second resumes further from the start it recorded.
    shutil.copytree(first / "checkpoints" / "step_000002", first / "checkpoints" / "step_000003")
    before = (run_dir / "eval_before.json").read_text()
    summary = train(load_config("configs/smoke.yaml", [*args, "train.steps=3"]))
    assert summary["rl_step_evaluated"] == 3
    assert json.loads((run_dir / "start.json").read_text()) == record
    assert (run_dir / "eval_before.json").read_text() == before

    out = tmp_path / "exported"
    assert cli(["export", str(run_dir), "--to", str(out)]) == 0
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
    proc, url = start(run_dir)
    try:
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(
            model="tiny", prompt="def add(a, b):\n", max_tokens=4, temperature=0
        )
        assert reply.usage.completion_tokens >= 1
    finally:
        stop(proc)


def test_adapters_take_their_input_as_it_comes_only_where_it_is_their_own_dtype(tiny_model_dir):
    """Adapters in their base's dtype skip peft's cast of their input (under bf16 autocast a bf16 activation
    went to fp32 and straight back): the same outputs bitwise. Adapters of another dtype than their base
    (a bf16 base, fp32 adapters) keep the cast, without which their matmul would mix dtypes."""
    from tempering.models.lora import add_adapters

    ids = torch.randint(0, 50, (2, 9))
    model = add_adapters(
        load_model(tiny_model_dir), tiny_model_dir, r=4, alpha=8, dropout=0.0, target_modules="all-linear"
    )
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    for m in model.modules():  # B = 0 at the start: make the adapters count
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B["default"].weight)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        as_they_come = model(ids).logits
        for m in layers:
            m.cast_input_dtype_enabled = True
        cast = model(ids).logits
    assert torch.equal(as_they_come, cast)

    bf16 = add_adapters(
        load_model(tiny_model_dir, dtype="bfloat16"),
        tiny_model_dir,
        r=4,
        alpha=8,
        dropout=0.0,
        target_modules="all-linear",
    )
    assert {p.dtype for n, p in bf16.named_parameters() if "lora_" in n} == {torch.float32}
    assert all(m.cast_input_dtype_enabled for m in bf16.modules() if hasattr(m, "cast_input_dtype_enabled"))
    with torch.no_grad():
        assert torch.isfinite(bf16(ids).logits).all()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_merged_copy_is_the_long_ways_bitwise_and_leaves_the_model_as_it_was(tiny_model_dir, dtype):
    """The engine's sampling copy (`merged_copy`: adapters folded in, tensors cast, no full fp32 copy first)
    against the long way, `merge(deepcopy(model)).to(dtype)`: the same tensors bitwise, tied weights still
    tied, the same logits; the trained model keeps its adapters and weights. DoRA adapters (which it does not
    fold itself) go the long way."""
    import copy

    from peft import LoraConfig, get_peft_model

    from tempering.models.lora import add_adapters, merge, merged_copy

    ids = torch.randint(0, 50, (2, 9))
    for model in (
        add_adapters(
            load_model(tiny_model_dir), tiny_model_dir, r=4, alpha=8, dropout=0.0, target_modules="all-linear"
        ),
        get_peft_model(
            load_model(tiny_model_dir), LoraConfig(r=4, target_modules="all-linear", use_dora=True)
        ),
    ):
        for m in model.modules():  # B = 0 at the start: make the adapters count
            if hasattr(m, "lora_B"):
                torch.nn.init.normal_(m.lora_B["default"].weight)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        quick = merged_copy(model, dtype)
        long = merge(copy.deepcopy(model))
        long = long.to(dtype) if dtype else long
        assert type(quick) is type(long) and not any("lora" in k for k in quick.state_dict())
        assert {k: (v.dtype, v.shape) for k, v in quick.state_dict().items()} == {
            k: (v.dtype, v.shape) for k, v in long.state_dict().items()
        }
        assert all(torch.equal(v, long.state_dict()[k]) for k, v in quick.state_dict().items())
        assert (quick.get_output_embeddings().weight is quick.get_input_embeddings().weight) == (
            long.get_output_embeddings().weight is long.get_input_embeddings().weight
        )
        with torch.no_grad():
            assert torch.equal(quick(ids).logits, long(ids).logits)
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
