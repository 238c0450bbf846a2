"""The engine: batch generation over the request-level scheduler - shapes, log-probs that match the
trainer's forward pass, per-row determinism, continuous batching, cancellation and prefix reuse."""

import threading
import time

import pytest
import torch

from tempering.envs import EnvContext
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.inference.generation import encode_prompt
from tempering.inference.protocol import Request
from tempering.inference.sampling import sample
from tempering.models.forward import response_logprobs
from tempering.rollout.episodes import run_episodes


def prompts_of(tokenizer, tasks, n):
    return [encode_prompt(tokenizer, t.prompt) for t in tasks[:n]]


def engine_of(tiny, **sampling):
    model, tokenizer = tiny
    return LocalEngine(model, tokenizer, SamplingParams(**sampling))


def test_shapes_masks_and_truncation(tiny, tasks):
    _, tokenizer = tiny
    prompts = prompts_of(tokenizer, tasks[0], 6)
    gen = engine_of(tiny, max_new_tokens=12).generate(prompts, generator=torch.Generator().manual_seed(0))
    b = len(prompts)
    assert gen.prompt_ids.shape[0] == gen.response_ids.shape[0] == b
    assert gen.response_ids.shape == gen.response_mask.shape == gen.logprobs.shape
    assert gen.response_ids.shape[1] <= 12
    eos = tokenizer.eos_token_id
    for i in range(b):
        n = int(gen.response_mask[i].sum())
        ids = gen.response_ids[i, :n].tolist()
        # masked-in tokens end with EOS exactly when not truncated; nothing after the mask is real
        assert (ids[-1] == eos) != bool(gen.truncated[i])
        assert eos not in ids[:-1]
        assert (gen.response_ids[i, n:] == tokenizer.pad_token_id).all()
        assert (gen.logprobs[i, n:] == 0).all() and (gen.logprobs[i, :n] < 0).all()
    assert (gen.prompt_mask[:, -1] == 1).all()  # left padding: every prompt row ends with real tokens


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.9)])
def test_sampler_logprobs_match_the_training_forward_pass(tiny, tasks, temperature, top_p):
    model, tokenizer = tiny
    distinct = prompts_of(tokenizer, tasks[0], 3)
    grouped = [p for p in distinct for _ in range(4)]  # a group's prompt is computed once and copied
    gen = engine_of(tiny, temperature=temperature, top_p=top_p, max_new_tokens=10).generate(
        grouped, generator=torch.Generator().manual_seed(1)
    )
    assert len({tuple(r) for r in gen.response_ids.tolist()}) > 3  # samples of a group differ
    with torch.no_grad():
        recomputed, _ = response_logprobs(
            model,
            gen.prompt_ids,
            gen.prompt_mask,
            gen.response_ids,
            gen.response_mask,
            temperature=temperature,
        )
    torch.testing.assert_close(recomputed * gen.response_mask, gen.logprobs, atol=2e-5, rtol=1e-5)


def test_seeded_generation_is_repeatable_and_seeds_differ(tiny, tasks):
    engine = engine_of(tiny, max_new_tokens=8)
    prompts = prompts_of(tiny[1], tasks[0], 4)
    a, b, c = (engine.generate(prompts, generator=torch.Generator().manual_seed(s)) for s in (3, 3, 4))
    assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
    assert not torch.equal(a.response_ids, c.response_ids)


def test_a_rows_tokens_depend_on_its_seed_and_context_not_on_its_batch(tiny, tasks):
    """The same request alone, inside batches of other requests, and arriving after others are running."""
    engine = engine_of(tiny)
    prompts = prompts_of(tiny[1], tasks[0], 6)

    def ask(prompt, seed):
        return engine.submit(Request(prompt, 16, temperature=1.0, seed=seed))

    alone = engine.run([ask(prompts[0], 42)])[0].ids
    crowd = [ask(p, 7 + i) for i, p in enumerate(prompts[1:])]
    mine = ask(prompts[0], 42)
    assert engine.run([mine, *crowd])[0].ids == alone
    early = [ask(p, 70 + i) for i, p in enumerate(prompts[1:])]
    for _ in range(3):  # others are decoding; it joins mid-way
        engine._step()
    late = ask(prompts[0], 42)
    assert engine.run([late, *early])[0].ids == alone


def test_greedy_matches_transformers_generate(tiny, tasks):
    model, tokenizer = tiny
    prompt = prompts_of(tokenizer, tasks[0], 1)
    ours = engine_of(tiny, max_new_tokens=8).generate(prompt, greedy=True)
    ref = model.generate(
        torch.tensor(prompt),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    n = int(ours.response_mask[0].sum())
    assert ours.response_ids[0, :n].tolist() == ref[0, len(prompt[0]) :][:n].tolist()


def test_top_p_keeps_only_the_nucleus_and_greedy_rows_take_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(300, 1)
    drawn = sample(logits, torch.ones(300), torch.full((300,), 0.7), torch.rand(300)).tokens
    assert set(drawn.tolist()) == {0, 1}
    mixed = sample(logits[:2], torch.tensor([0.0, 1.0]), torch.ones(2), torch.tensor([0.9, 0.9])).tokens
    assert mixed.tolist() == [0, 2]  # row 0 greedy; row 1 at u=0.9 lands in the 0.15 token's interval


def test_rows_join_at_the_next_step_and_a_cancelled_row_leaves_at_the_next(tiny, tasks):
    """Continuous batching on the engine's own loop: a request submitted while others decode joins them
    (its first token comes before theirs are done); a cancelled request is gone after one more step."""
    engine = engine_of(tiny)
    prompts = prompts_of(tiny[1], tasks[0], 3)
    steps = []
    step = engine.scheduler.step

    def counted():
        steps.append(len(engine.scheduler.rows))
        step()
        time.sleep(0.002)  # a slow model: the other thread gets a word in

    engine.scheduler.step = counted
    engine.start()
    try:
        long = engine.submit(Request(prompts[0], 150, seed=1))
        while not steps:
            time.sleep(0.001)
        joined = threading.Event()
        late = engine.submit(Request(prompts[1], 3, seed=2, on_token=lambda *a: joined.set() or False))
        assert joined.wait(5) and not long.done()  # joined while the long one runs
        assert late.result(10).finish_reason == "length"
        victim = engine.submit(Request(prompts[2], 150, seed=3))
        while not victim.done() and len(engine.scheduler.rows) < 2:
            time.sleep(0.001)
        victim.cancel()
        done = victim.result(10)
        assert done.finish_reason == "cancelled" and len(done.ids) < 150
        long.cancel()
        long.result(10)
    finally:
        engine.close()


def test_a_next_turn_that_extends_a_kept_sequence_computes_only_its_new_tokens(tiny, tasks):
    engine = engine_of(tiny, max_new_tokens=6)
    prompts = prompts_of(tiny[1], tasks[0], 2)
    first = engine.generate(prompts, generator=torch.Generator().manual_seed(0), keep=True)
    computed = engine.scheduler.prefilled
    follow = [
        p + first.response_ids[i, : int(first.response_mask[i].sum())].tolist() + [5, 6, 7]
        for i, p in enumerate(prompts)
    ]
    second = engine.generate(follow, generator=torch.Generator().manual_seed(1))
    assert second.reused == [len(p) + int(first.response_mask[i].sum()) - 1 for i, p in enumerate(prompts)]
    assert engine.scheduler.prefilled - computed == 2 * (1 + 3)  # the last action token and the observation
    fresh = engine_of(tiny, max_new_tokens=6).generate(follow, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fresh.response_ids, second.response_ids)
    torch.testing.assert_close(fresh.logprobs, second.logprobs, atol=1e-5, rtol=0)
    engine.load_weights(tiny[0].state_dict(), version=1)  # new weights: kept caches are stale
    assert engine.scheduler.kept == []


def test_single_turn_code_episodes_group_and_execute(tiny, tasks, sandbox):
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=8), version=3)
    episodes = run_episodes(
        engine,
        tasks[0][:3],
        EnvContext(sandbox),
        group_size=4,
        max_context=1024,
        generator=torch.Generator().manual_seed(0),
    )
    assert [e.group_id for e in episodes] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(len(e.turns) == 1 and len(e.turns[0].attempt.exec_result.tests) == 8 for e in episodes)
    assert episodes[4].task is tasks[0][1] and {e.version for e in episodes} == {3}
    # The same draws as sampling the prompts directly: one rollout path, no re-tokenization.
    gen = engine.generate(
        [encode_prompt(tokenizer, t.prompt) for t in tasks[0][:3] for _ in range(4)],
        generator=torch.Generator().manual_seed(0),
    )
    assert [e.turns[0].action for e in episodes] == gen.texts
    assert gen.finish_reasons == ["length" if t else "stop" for t in gen.truncated.tolist()]


def test_decoded_completion_round_trips_through_the_tokenizer(tiny, tasks):
    model, tokenizer = tiny
    gen = engine_of(tiny, max_new_tokens=10).generate(
        [encode_prompt(tokenizer, t.prompt) for t in tasks[0][:2] for _ in range(2)],
        generator=torch.Generator().manual_seed(0),
    )
    for i, (text, truncated) in enumerate(zip(gen.texts, gen.truncated.tolist())):
        n = int(gen.response_mask[i].sum()) - (0 if truncated else 1)
        assert tokenizer.decode(gen.response_ids[i, :n].tolist()) == text


def test_engine_logprobs_use_its_temperature_and_weights_sync_by_version(tiny, tasks):
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(temperature=0.7, max_new_tokens=6))
    gen = engine.generate(
        [encode_prompt(tokenizer, t.prompt) for t in tasks[0][:3]], generator=torch.Generator().manual_seed(1)
    )
    logprobs = engine.logprobs(gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
    torch.testing.assert_close(logprobs * gen.response_mask, gen.logprobs, atol=2e-5, rtol=0)
    # Another process's weights are copied in; the engine's own storage is not copied again.
    other = {k: v.clone() + 0.01 for k, v in model.state_dict().items()}
    engine.load_weights(model.state_dict(), version=1)
    assert engine.version == 1
    engine.load_weights(other, version=2)
    assert engine.version == 2 and torch.equal(
        next(iter(model.state_dict().values())), next(iter(other.values()))
    )


def test_a_bf16_engine_samples_from_a_bf16_copy_close_to_the_fp32_policy(tiny, tasks):
    """Mixed precision (`model.compute: bfloat16`): the engine samples from a packed bf16 copy; the policy's
    own weights stay fp32, and the log-probs it reports are the fp32 policy's up to bf16 rounding."""
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(1.0, 1.0, 10), dtype=torch.bfloat16)
    prompts = [p for p in prompts_of(tokenizer, tasks[0], 3) for _ in range(2)]
    gen = engine.generate(prompts, generator=torch.Generator().manual_seed(3))
    assert next(engine._copy.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        fp32, _ = response_logprobs(
            model, gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask
        )
    diff = ((fp32 - gen.logprobs) * gen.response_mask).abs()
    assert 0 < float(diff.max()) < 0.1  # bf16 rounding: not the same numbers, close ones
    engine.release()
    assert engine._copy is None and engine.scheduler.model is model


def test_packed_bf16_linear_layers_give_the_plain_layers_outputs():
    from tempering.inference.engine import prepacked

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Linear(96, 8, bias=False)).to(torch.bfloat16)
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = net(x)
        packed = prepacked(net)(x)
    if torch.backends.mkldnn.is_available():
        assert type(net[0]).__name__ == "_PackedLinear"
    assert torch.equal(plain, packed)


def test_bf16_compute_is_refused_where_it_is_slower_and_auto_falls_back(monkeypatch):
    from tempering.errors import ConfigError
    from tempering.models import loading

    monkeypatch.setattr(loading, "bf16_fast", lambda device: False)  # a CPU without AMX
    with pytest.raises(ConfigError, match="model.compute=bfloat16 is slower than float32"):
        loading.compute_dtype("bfloat16", "cpu")
    assert loading.compute_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(loading, "bf16_fast", lambda device: True)
    assert loading.compute_dtype("auto", "cpu") == loading.compute_dtype("bfloat16", "cpu") == torch.bfloat16
    assert loading.compute_dtype("float32", "cpu") == torch.float32


def test_open_model_checks_device_and_compute_before_loading(tmp_path):
    from tempering.errors import ConfigError
    from tempering.inference.engine import open_model

    missing = tmp_path / "no-model"  # never read: the settings fail first
    with pytest.raises(ConfigError, match=r"--device=cuda:9 but"):
        open_model(missing, device="cuda:9", keys=("--device", "--compute"))
    with pytest.raises(ConfigError, match=r"model.compute=float8: expected one of"):
        open_model(missing, device="cpu", compute="float8")


def test_eval_serve_repair_and_the_pipeline_open_models_one_way(tiny_model_dir, tasks, tmp_path, monkeypatch):
    """`tempering eval`, `load_local` (repair, serve) and the pipeline's evaluations all go through
    `inference.engine.open_model`, with their own settings."""
    import tempering.inference.engine as engines
    import tempering.pipeline
    from tempering.agent.backends import load_local
    from tempering.cli import main as cli
    from tempering.config import build_config
    from tempering.data import save_tasks

    opened = []
    real = engines.open_model

    def spy(model_dir, sampling=engines.DEFAULT_SAMPLING, **kw):
        opened.append((str(model_dir), sampling, kw.get("keys"), kw.get("max_rows")))
        return real(model_dir, sampling, **kw)

    monkeypatch.setattr(engines, "open_model", spy)
    monkeypatch.setattr(tempering.pipeline, "open_model", spy)
    save_tasks(tasks[1][:1], tmp_path / "tasks.jsonl")
    assert (
        cli(
            [
                "eval",
                str(tiny_model_dir),
                "--tasks",
                str(tmp_path / "tasks.jsonl"),
                "--samples",
                "1",
                "--max-new-tokens",
                "4",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    served = load_local(tiny_model_dir, max_rows=3)
    engine = tempering.pipeline.config_engine(build_config(), tiny_model_dir, SamplingParams(0.5, 1.0, 7))
    flags = ("--device", "--compute")
    assert opened == [
        (str(tiny_model_dir), SamplingParams(1.0, 1.0, 4), flags, None),
        (str(tiny_model_dir), SamplingParams(), flags, 3),
        (str(tiny_model_dir), SamplingParams(0.5, 1.0, 7), None, None),
    ]
    assert served.engine.scheduler.max_rows == 3 and engine.sampling.max_new_tokens == 7
