import torch

from tempering.envs import EnvContext
from tempering.models.forward import response_logprobs
from tempering.rollout.engine import LocalEngine, SamplingParams
from tempering.rollout.episodes import run_episodes
from tempering.rollout.generate import encode_prompt, generate, sample_next


def prompts_of(tokenizer, tasks, n):
    return [encode_prompt(tokenizer, t.prompt) for t in tasks[:n]]


def test_shapes_masks_and_truncation(tiny, tasks):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer, tasks[0], 6)
    gen = generate(model, tokenizer, prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(0))
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
    # left padding: every prompt row ends with real tokens
    assert (gen.prompt_mask[:, -1] == 1).all()


def test_sampler_logprobs_match_the_training_forward_pass(tiny, tasks):
    model, tokenizer = tiny
    gen = generate(model, tokenizer, prompts_of(tokenizer, tasks[0], 5), max_new_tokens=10, temperature=0.7,
                   generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        recomputed, _ = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                          gen.response_mask, temperature=0.7)
    torch.testing.assert_close(recomputed * gen.response_mask, gen.logprobs, atol=2e-4, rtol=1e-4)


def test_grouped_prompts_share_a_cache_and_still_match_the_forward_pass(tiny, tasks):
    model, tokenizer = tiny
    distinct = prompts_of(tokenizer, tasks[0], 3)
    grouped = [p for p in distinct for _ in range(4)]                  # GRPO layout: each prompt 4 times
    gen = generate(model, tokenizer, grouped, max_new_tokens=10, generator=torch.Generator().manual_seed(2))
    assert len({tuple(r) for r in gen.response_ids.tolist()}) > 3      # samples of a group differ
    for share in (True, False):
        with torch.no_grad():
            recomputed, _ = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                              gen.response_mask, share_prompts=share)
        torch.testing.assert_close(recomputed * gen.response_mask, gen.logprobs, atol=2e-4, rtol=1e-4)


def test_seeded_generation_is_repeatable_and_seeds_differ(tiny, tasks):
    model, tokenizer = tiny
    prompts = prompts_of(tokenizer, tasks[0], 4)
    a = generate(model, tokenizer, prompts, max_new_tokens=8, generator=torch.Generator().manual_seed(3))
    b = generate(model, tokenizer, prompts, max_new_tokens=8, generator=torch.Generator().manual_seed(3))
    c = generate(model, tokenizer, prompts, max_new_tokens=8, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
    assert not torch.equal(a.response_ids, c.response_ids)


def test_greedy_matches_transformers_generate(tiny, tasks):
    model, tokenizer = tiny
    prompt = prompts_of(tokenizer, tasks[0], 1)
    ours = generate(model, tokenizer, prompt, max_new_tokens=8, greedy=True)
    ref = model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    n = int(ours.response_mask[0].sum())
    assert ours.response_ids[0, :n].tolist() == ref[0, len(prompt[0]):][:n].tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, temperature=1.0, top_p=0.7, generator=gen, greedy=False)[0]) for _ in range(300)}
    assert drawn == {0, 1}


def test_single_turn_code_episodes_group_and_execute(tiny, tasks, sandbox):
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=8), version=3)
    episodes = run_episodes(engine, tasks[0][:3], EnvContext(sandbox), group_size=4, max_context=1024,
                            generator=torch.Generator().manual_seed(0))
    assert [e.group_id for e in episodes] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(len(e.turns) == 1 and len(e.turns[0].info["attempt"].exec_result.tests) == 8 for e in episodes)
    assert episodes[4].task is tasks[0][1] and {e.version for e in episodes} == {3}
    # The same draws as sampling the prompts directly: one rollout path, no re-tokenization.
    gen = engine.generate([encode_prompt(tokenizer, t.prompt) for t in tasks[0][:3] for _ in range(4)],
                          generator=torch.Generator().manual_seed(0))
    assert [e.turns[0].action for e in episodes] == gen.texts
    assert gen.finish_reasons == ["length" if t else "stop" for t in gen.truncated.tolist()]


def test_decoded_completion_round_trips_through_the_tokenizer(tiny, tasks):
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=10))
    gen = engine.generate([encode_prompt(tokenizer, t.prompt) for t in tasks[0][:2] for _ in range(2)],
                          generator=torch.Generator().manual_seed(0))
    for i, (text, truncated) in enumerate(zip(gen.texts, gen.truncated.tolist())):
        n = int(gen.response_mask[i].sum()) - (0 if truncated else 1)
        assert tokenizer.decode(gen.response_ids[i, :n].tolist()) == text


def test_engine_logprobs_use_its_temperature_and_weights_sync_by_version(tiny, tasks):
    model, tokenizer = tiny
    engine = LocalEngine(model, tokenizer, SamplingParams(temperature=0.7, max_new_tokens=6))
    gen = engine.generate([encode_prompt(tokenizer, t.prompt) for t in tasks[0][:3]],
                          generator=torch.Generator().manual_seed(1))
    logprobs = engine.logprobs(gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
    torch.testing.assert_close(logprobs * gen.response_mask, gen.logprobs, atol=2e-4, rtol=0)
    # Another process's weights are copied in; the engine's own storage is not copied again.
    other = {k: v.clone() + 0.01 for k, v in model.state_dict().items()}
    engine.load_weights(model.state_dict(), version=1)
    assert engine.version == 1
    engine.load_weights(other, version=2)
    assert engine.version == 2 and torch.equal(next(iter(model.state_dict().values())), next(iter(other.values())))
