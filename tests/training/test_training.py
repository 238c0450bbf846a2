import functools
import warnings

import pytest
import torch

from tempering.algos import ppo_clip_loss
from tempering.data.tasks import sft_completion
from tempering.inference.engine import LocalEngine, SamplingParams
from tempering.models.forward import response_logprobs
from tempering.training.optim import make_optimizer, make_scheduler
from tempering.training.sft import encode_examples, run_sft
from tempering.training.update import UpdateSettings, update_policy
from tests.helpers.batches import make_batch


def test_sft_completion_is_the_body_after_the_signature(tasks):
    task = tasks[0][0]
    body = sft_completion(task)
    assert body.startswith("    ") and task.prompt + body != task.reference_solution
    assert task.reference_solution.endswith(body)


def test_sft_learns_the_training_examples(tiny, tasks):
    model, tokenizer = tiny
    few = tasks[0][:8]
    history = run_sft(model, tokenizer, few, steps=60, batch_size=8, lr=3e-3, warmup_steps=5, seed=0)
    assert history[-1]["sft/loss"] < 0.5 * history[0]["sft/loss"]
    # The first completion is now the greedy answer (memorised).
    prompt, completion = encode_examples(tokenizer, few[:1])[0]
    gen = LocalEngine(model, tokenizer, SamplingParams(max_new_tokens=len(completion) + 2)).generate(
        [prompt], greedy=True
    )
    assert gen.response_ids[0, : len(completion)].tolist() == completion


def test_update_raises_the_likelihood_of_rewarded_samples(tiny, tasks):
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:2], [1.0, 0.0, 0.0, 1.0])
    opt = make_optimizer(
        model, lr=1e-3
    )  # (each minibatch is one group: at 1e-2 one group's step can undo the other's)

    def seq_logp():
        with torch.no_grad():
            lp, _ = response_logprobs(
                model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
            )
        return (lp * batch.response_mask).sum(1)

    before = seq_logp()
    settings = UpdateSettings(epochs=2, minibatches=2)
    metrics = update_policy(model, opt, batch, ppo_clip_loss, settings, torch.Generator().manual_seed(0))
    after = seq_logp()
    delta = after - before
    assert delta[0] > delta[1] and delta[3] > delta[2]  # winners gain relative to losers in each group
    assert {"actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"} <= set(
        metrics
    )


def test_a_mixed_precision_update_keeps_fp32_weights_and_raises_the_rewarded_samples(tiny, tasks):
    """`model.compute: bfloat16`: the update under autocast - bf16 matmuls, fp32 parameters, optimizer state,
    gradients and log-softmax - moves the policy as the fp32 update does."""
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:2], [1.0, 0.0, 0.0, 1.0])
    with torch.no_grad():
        fp32, _ = response_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed, _ = response_logprobs(
                model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
            )
    assert mixed.dtype == torch.float32 and 0 < float((mixed - fp32).abs().max()) < 0.1
    opt = make_optimizer(model, lr=1e-3)  # as the fp32 test's
    before = (fp32 * batch.response_mask).sum(1)
    update_policy(
        model,
        opt,
        batch,
        ppo_clip_loss,
        UpdateSettings(epochs=2, minibatches=2, compute=torch.bfloat16),
        torch.Generator().manual_seed(0),
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        after, _ = response_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
        )
    delta = (after * batch.response_mask).sum(1) - before
    assert delta[0] > delta[1] and delta[3] > delta[2]


def test_each_mixed_precision_minibatch_runs_on_the_weights_of_the_step_before(tiny, tasks):
    """Two minibatches in one update are the two minibatches one after the other: the second one's bf16
    matmuls use the weights after the first step (autocast caches each trainable weight's cast for as long as
    its region lasts: a region around both would run the second on the weights from before the first)."""
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:2], [1.0, 0.0, 0.0, 1.0])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    update_policy(
        model,
        make_optimizer(model, lr=1e-2),
        batch,
        ppo_clip_loss,
        UpdateSettings(minibatches=2, compute=torch.bfloat16),
        torch.Generator().manual_seed(0),
    )
    together = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(start)
    opt = make_optimizer(model, lr=1e-2)
    for index in batch.minibatches(2, torch.Generator().manual_seed(0)):
        update_policy(
            model,
            opt,
            batch.select(index),
            ppo_clip_loss,
            UpdateSettings(compute=torch.bfloat16),
            torch.Generator().manual_seed(0),
        )
    assert all(torch.equal(a, b) for a, b in zip(together, model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(together, start.values()))


def test_the_update_trains_on_the_kept_tokens_as_if_the_rejected_were_never_sampled(tiny, tasks):
    """MIS's rejected tokens (`kept_mask`) are out of every loss of the update (policy, entropy, KL): the same
    step as on a batch whose response mask never had them (attention unchanged)."""
    import copy

    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:2], [1.0, 0.0, 0.0, 1.0])
    batch.ref_logprobs = batch.old_logprobs - 0.1 * batch.response_mask
    kept = batch.response_mask.clone()
    kept[0, 1:3] = 0.0
    kept[2] = 0.0  # a whole sequence rejected (sequence-level MIS)
    assert kept[:, -1].any()  # so both batches keep the same width
    rejected = copy.copy(batch)
    rejected.kept_mask = kept
    never = copy.copy(batch)
    never.response_mask, never.response_attention = kept, batch.response_mask
    start = copy.deepcopy(model)
    out = []
    for b in (rejected, never):
        m = copy.deepcopy(start)
        loss = functools.partial(ppo_clip_loss, loss_agg="seq-mean-token-mean")
        settings = UpdateSettings(loss_agg="seq-mean-token-mean", entropy_coef=0.01)
        metrics = update_policy(
            m,
            torch.optim.SGD(m.parameters(), lr=0.5),
            b,
            loss,
            settings,
            torch.Generator().manual_seed(0),
            kl_coef=0.1,
        )
        out.append((metrics, [p.detach().clone() for p in m.parameters()]))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-5, abs=1e-7)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(out[0][1], out[1][1]))


def test_zero_advantage_batch_leaves_weights_unchanged(tiny, tasks):
    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:2], [0.5, 0.5, 1.0, 1.0])  # no variance in either group
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # plain SGD: zero gradient means no step at all
    update_policy(model, opt, batch, ppo_clip_loss, UpdateSettings(), torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_schedule_warmup_then_constant_or_cosine():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = make_scheduler(opt, warmup_steps=4, total_steps=10, schedule="cosine")
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] > lrs[9] >= 0.1


def plain_logprobs(model, batch, temperature=1.0):
    """The reference: each row alone, prompt + response as one unpadded sequence, full logits."""
    rows = []
    for i in range(len(batch.prompt_ids)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        n = int(batch.response_mask[i].sum())
        ids = torch.cat([prompt, batch.response_ids[i, :n]])
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float() / temperature, -1)
        lp = logp[len(prompt) - 1 : len(prompt) - 1 + n].gather(-1, ids[len(prompt) :, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)[len(prompt) - 1 : len(prompt) - 1 + n]
        rows.append(
            (
                torch.nn.functional.pad(lp, (0, batch.response_ids.shape[1] - n)),
                torch.nn.functional.pad(ent, (0, batch.response_ids.shape[1] - n)),
            )
        )
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def test_the_packed_forward_has_the_values_and_gradients_of_the_plain_per_row_pass(tiny, tasks, monkeypatch):
    """Rows sharing a prompt run as one packed sequence, logits in chunks recomputed in the backward pass: the same log-probs,
    entropies and gradients as each row alone (several groups, responses of different lengths) - with the
    groups in one forward or in one forward each."""
    from tempering.models import forward

    model, tokenizer = tiny
    batch = make_batch(model, tokenizer, tasks[0][:3], [1.0, 0.0, 0.0, 1.0, 0.5, 0.0])
    for i, n in enumerate([6, 3, 5, 2, 6, 4]):  # responses of different lengths
        batch.response_mask[i, n:] = 0.0
    grads, values, forwards = [], [], []
    packed = forward._packed
    monkeypatch.setattr(forward, "_packed", lambda *args: forwards.append(len(args[3])) or packed(*args))
    # the reference; groups packed in one forward; one forward each; groups too long to pack (rows alone)
    for pack, slack in ((None, None), (4096, 10.0), (4096, 0.0), (10, 0.1)):
        model.zero_grad(set_to_none=True)
        if pack:
            monkeypatch.setattr(forward, "CHUNK", 5)  # several chunks, each recomputed in the backward pass
            monkeypatch.setattr(forward, "PACK", pack)
            monkeypatch.setattr(forward, "SLACK", slack)
            lp, ent = response_logprobs(
                model,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.response_ids,
                batch.response_mask,
                with_entropy=True,
            )
        else:
            lp, ent = plain_logprobs(model, batch)
        mask = batch.response_mask
        ((lp * batch.advantages * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        values.append((lp.detach() * mask, ent.detach() * mask))
    assert grads[0].abs().max() > 0
    assert forwards == [3, 1, 1, 1]  # the groups differ in length
    for k in (1, 2, 3):
        torch.testing.assert_close(values[k], values[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[k], grads[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cap", [None, 3.0])
def test_the_heads_log_softmax_node_has_the_gradients_of_the_plain_operations(cap):
    """`HeadLogprobs` (the output head, log-softmax and entropy, gradients written out) against autograd
    through the plain operations: log-probs and entropies, and the gradients of the hidden states, the head's
    weight and its bias under a loss on both - with a temperature and with soft-capped logits, in chunks."""
    from tempering.models.forward import HeadLogprobs, _chunk_logprobs

    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(16, 50), torch.randn(70, 16, requires_grad=True)
    targets, weights = torch.randint(0, 50, (70,)), torch.randn(2, 70)
    grads, values = [], []
    for fused in (False, True):
        head.zero_grad()
        hidden.grad = None
        if fused:
            lp, ent = HeadLogprobs.apply(hidden, head.weight, head.bias, targets, 0.7, cap, None, True)
        else:
            lp, ent = _chunk_logprobs(head, hidden, targets, 0.7, cap)
        (lp * weights[0] + ent * weights[1]).sum().backward()
        values.append((lp.detach(), ent.detach()))
        grads.append([hidden.grad, head.weight.grad, head.bias.grad])
    assert torch.equal(values[1][0], values[0][0])  # the same operations in the same order
    torch.testing.assert_close(values[1][1], values[0][1], atol=1e-5, rtol=1e-5)
    for fused, plain in zip(grads[1], grads[0]):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-4)


def test_the_heads_chunks_keep_their_logits_under_the_mmap_threshold_and_change_no_number(monkeypatch):
    """A chunk's logits stay under `LOGITS` (SmolLM2's 49k vocabulary: 128 tokens a chunk; a 1k vocabulary
    keeps `CHUNK`), and the chunk size changes nothing: log-probs bitwise, gradients to float tolerance."""
    from tempering.models import forward
    from tempering.models.forward import CHUNK, LOGITS, HeadLogprobs, chunk_tokens

    assert (
        chunk_tokens(49152) == 128 and chunk_tokens(1024) == CHUNK and chunk_tokens(151936) * 151936 < LOGITS
    )
    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(16, 50), torch.randn(70, 16, requires_grad=True)
    targets, weights = torch.randint(0, 50, (70,)), torch.randn(2, 70)
    runs = []
    for logits in (LOGITS, 8 * 50 + 1):  # one chunk of 70 tokens; then chunks of 8 (the last one of 6)
        monkeypatch.setattr(forward, "LOGITS", logits)
        head.zero_grad()
        hidden.grad = None
        lp, ent = HeadLogprobs.apply(hidden, head.weight, head.bias, targets, 0.7, None, None, True)
        (lp * weights[0] + ent * weights[1]).sum().backward()
        runs.append(
            (lp.detach(), ent.detach(), hidden.grad, head.weight.grad.clone(), head.bias.grad.clone())
        )
    assert chunk_tokens(50) == 8
    assert torch.equal(runs[1][0], runs[0][0])
    for chunked, whole in zip(runs[1][1:], runs[0][1:]):
        torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-4)


def test_in_bf16_the_heads_log_probs_are_those_of_the_autocast_head():
    """Under bf16 autocast the node's matmul runs in bf16 as the head's own would: bitwise the same log-probs."""
    from tempering.models.forward import HeadLogprobs, _chunk_logprobs

    torch.manual_seed(0)
    head, hidden, targets = (
        torch.nn.Linear(16, 50, bias=False),
        torch.randn(70, 16),
        torch.randint(0, 50, (70,)),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, _ = _chunk_logprobs(head, hidden, targets, 1.0, None)
        fused, _ = HeadLogprobs.apply(hidden, head.weight, None, targets, 1.0, None, torch.bfloat16, False)
        fp32, _ = HeadLogprobs.apply(hidden, head.weight, None, targets, 1.0, None, None, False)
    assert torch.equal(fused, plain) and not torch.equal(fp32, plain)


def test_with_dropout_in_the_model_the_ratio_is_one_before_the_first_step(tiny_model_dir, tasks):
    """A model whose config has dropout (attention dropout 0.5) and LoRA adapters with dropout 0.5: the
    sampler's log-probs come from eval mode, so must the update's - else the PPO ratio is not 1 before the
    first optimizer step and clipping acts on dropout noise. Also with gradient checkpointing."""
    from tempering.models.loading import load_model, load_tokenizer
    from tempering.models.lora import add_adapters

    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir)
        model.config.attention_dropout = 0.5
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.5
        model = add_adapters(model, tiny_model_dir, r=4, alpha=8, dropout=0.5, target_modules="all-linear")
        batch = make_batch(model, load_tokenizer(tiny_model_dir), tasks[0][:4], [1.0, 0.0, 0.0, 1.0] * 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = update_policy(
                model,
                torch.optim.SGD(model.parameters(), lr=0.0),
                batch,
                ppo_clip_loss,
                UpdateSettings(gradient_checkpointing=checkpointing),
                torch.Generator().manual_seed(0),
            )
        assert metrics["actor/pg_clipfrac"] == 0.0 and abs(metrics["actor/ppo_kl"]) < 1e-6, (
            checkpointing,
            metrics,
        )
        assert (
            model.training
        )  # left as it was found, checkpointing off again, without transformers' deprecations
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        assert not [w for w in caught if "checkpointing" in str(w.message)], [str(w.message) for w in caught]
