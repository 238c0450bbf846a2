"""Shared fixtures: a few built-in tasks, a tiny model directory, a sandbox."""

from __future__ import annotations

import pytest
import torch

from tempering.data import generate_tasks
from tempering.data.tasks import sft_completion
from tempering.models.loading import build_tiny_model, load_model, load_tokenizer, save_model
from tempering.models.tokenizer import train_tokenizer
from tempering.sandbox import LocalSandbox
from tempering.training.optim import make_optimizer, make_scheduler
from tests.helpers.runs import tempering


@pytest.fixture(scope="session")
def tasks():
    train, heldout = generate_tasks(200, 24, seed=7)
    return train, heldout


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tasks):
    """A real Hugging Face model directory (tokenizer included) of a randomly initialised tiny Llama."""
    train, _ = tasks
    tokenizer = train_tokenizer([t.prompt + sft_completion(t) for t in train], vocab_size=320)
    model = build_tiny_model(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_length=192, seed=0
    )
    return save_model(model, tokenizer, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture()
def tiny(tiny_model_dir):
    torch.manual_seed(0)
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def sandbox():
    with LocalSandbox(workers=2) as sb:
        yield sb


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "smoke"
    proc = tempering("train", "configs/smoke.yaml", f"run.dir={run_dir}")
    (run_dir.parent / "train.stdout").write_text(proc.stdout)  # what `tempering train` printed
    return run_dir


@pytest.fixture()
def parts(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    opt = make_optimizer(model, lr=1e-3)
    sched = make_scheduler(opt, warmup_steps=3, total_steps=10)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    sched.step()
    return model, tokenizer, opt, sched
