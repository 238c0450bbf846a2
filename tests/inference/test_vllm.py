"""vLLM behind the engine protocol (marker `vllm`; `make test-vllm` runs these in the venv `make vllm` builds,
CPU here, a GPU where one is lent): the same greedy tokens and log-probs as the local engine on SmolLM2,
log-probs of given responses, weights pushed by `load_weights` take effect, samples record the version."""

import random

import pytest
import torch

vllm = pytest.importorskip("vllm")

from tempering.inference.chat import chat_format  # noqa: E402
from tempering.inference.engine import SamplingParams, make_engine  # noqa: E402
from tempering.models.loading import load_model, load_tokenizer  # noqa: E402
from tempering.models.registry import prepare  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def smollm2():
    path = prepare("smollm2-135m-instruct", log=lambda *_: None)
    return path, load_model(path).eval(), load_tokenizer(path)


@pytest.fixture(scope="module")
def engines(smollm2):
    path, model, tokenizer = smollm2
    sampling = SamplingParams(1.0, 1.0, 24)

    def seeded():
        random.seed(7)
        torch.manual_seed(7)

    seeded()
    expected = (random.random(), torch.rand(2).tolist())
    seeded()
    remote = make_engine(str(path), tokenizer, sampling, kind="vllm")  # vLLM seeds the global generators
    callers_draws_kept = (random.random(), torch.rand(2).tolist()) == expected
    return remote, make_engine(model, tokenizer, sampling), callers_draws_kept


def prompts(tokenizer):
    fmt = chat_format(tokenizer)
    return [fmt.start(q)[0] for q in ("Write a Python function add(a, b).", "What is 2 + 3?")]


def test_greedy_tokens_and_logprobs_match_the_local_engine(engines, smollm2):
    remote, local, _ = engines
    contexts = prompts(smollm2[2])
    a, b = remote.generate(contexts, greedy=True), local.generate(contexts, greedy=True)
    assert a.texts == b.texts
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=2e-3, rtol=0)
    scored = remote.logprobs(b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask)
    torch.testing.assert_close(scored * b.response_mask, b.logprobs, atol=2e-3, rtol=0)


def test_sampling_is_seeded_by_the_callers_generator(engines, smollm2):
    remote, _, _ = engines
    contexts = prompts(smollm2[2]) * 2
    a = remote.generate(contexts, generator=torch.Generator().manual_seed(1))
    b = remote.generate(contexts, generator=torch.Generator().manual_seed(1))
    assert a.texts == b.texts and a.version == remote.version


def test_loaded_weights_take_effect_and_samples_record_the_version(engines, smollm2):
    remote, _, _ = engines
    _, model, tokenizer = smollm2
    contexts = prompts(tokenizer)[:1]
    before = remote.generate(contexts, greedy=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] * 0.0  # every token equally likely
    remote.load_weights(state, version=5)
    flat = remote.generate(contexts, greedy=True)
    assert flat.version == 5 and flat.texts != before.texts
    remote.load_weights(model.state_dict(), version=6)
    assert remote.generate(contexts, greedy=True).texts == before.texts


def test_starting_the_engine_leaves_the_callers_random_draws_as_they_were(engines):
    assert engines[2]  # Python's and torch's global generators: LoRA dropout, a resumed run's state
