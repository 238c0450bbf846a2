"""Token exactness of recording sessions across chat-template families: ChatML (SmolLM2's), a Qwen3-style
template with reasoning tags (it strips `<think>` blocks from assistant turns before the last user query when
it re-renders), and Llama 3's headers. The templates are minimal versions of each family's structure, set on
the tiny model's tokenizer; a scripted head writes a fixed reply whose text re-tokenizes to its own ids."""

import pytest
import torch

from tempering.models.loading import load_model, load_tokenizer
from tests.helpers.sessions import agent, check_computed, open_session, post, serving

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3 = (
    "{% set ns = namespace(query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.query = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.query and '</think>' in m['content'] %}"
    "<|im_start|>assistant\n{{ m['content'].split('</think>')[-1].lstrip('\n') }}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
TEMPLATES = {"chatml": CHATML, "qwen3": QWEN3, "llama3": LLAMA3}


@pytest.fixture()
def serve():
    yield from serving()


def templated(model_dir, family: str, reply: str):
    """The tiny model with `family`'s template, scripted to answer every prompt with `reply`'s tokens, its
    last one repeated."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[family]})
    tokenizer.chat_template = TEMPLATES[family]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    script = tokenizer(reply, add_special_tokens=False).input_ids
    assert len(set(script)) == len(script) and prompt[-1] not in script
    scripted(model, {prompt[-1]: script[0], **dict(zip(script, script[1:])), script[-1]: script[-1]})
    return model, tokenizer


def scripted(model, chain: dict[int, int]) -> None:
    """A bigram model: the layers write nothing, so the last hidden state is a function of the current token
    alone, and the head maps each key token's state to a large logit on its successor."""
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    src, dst = torch.tensor(list(chain)), torch.tensor(list(chain.values()))
    with torch.no_grad():
        hidden = model.model(src[None]).last_hidden_state[0]  # (S, d), one row per key token
        target = torch.zeros(len(src), model.get_input_embeddings().num_embeddings)
        target[torch.arange(len(src)), dst] = 40.0
        head = torch.nn.Linear(hidden.shape[1], target.shape[1], bias=False)
        head.weight.copy_((torch.linalg.pinv(hidden) @ target).T)  # (V, d): hidden @ W.T == target
    model.lm_head = head


def check_branches(records: list[dict], handles) -> None:
    """Each record is one branch as computed: the calls whose prompt and sampled ids begin the record's
    ids are its calls; it ends with the last one's, and its mask is exactly their sampled spans."""
    done = [h.result() for h in handles]
    for record in records:
        calls = [c for c in done if record["ids"][: len(c.prompt) + len(c.ids)] == c.prompt + c.ids]
        assert len(calls) == record["turns"] and record["ids"] == calls[-1].prompt + calls[-1].ids
        sampled = {len(c.prompt) + i: lp for c in calls for i, lp in enumerate(c.logprobs)}
        assert [i for i, m in enumerate(record["mask"]) if m] == sorted(sampled)
        assert [record["logprobs"][i] for i in sorted(sampled)] == pytest.approx(
            [sampled[i] for i in sorted(sampled)]
        )


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_a_session_with_a_tool_result_is_token_exact_on_chatml_and_llama3(serve, tiny_model_dir, family):
    model, tokenizer = templated(tiny_model_dir, family, "x")
    url, handles = serve(model, tokenizer)
    session, client = open_session(url)
    start = [{"role": "system", "content": "Fix it."}, {"role": "user", "content": "def f(x):"}]
    agent(client, start, turns=3, streamed={1}, max_tokens=6)  # answer, tool result, answer, user, ...
    (record,) = post(url, session, "close").json()["records"]
    assert (record["turns"], record["forks"], record["token_exact_fraction"]) == (3, 0, 1.0)
    assert record["rerender_exact_fraction"] == 1.0
    check_computed(record, handles)
    assert all(tokenizer.decode(h.result().ids) == "x" * 6 for h in handles)


def test_a_qwen3_template_that_strips_earlier_reasoning_forks_and_never_merges(serve, tiny_model_dir):
    model, tokenizer = templated(tiny_model_dir, "qwen3", "<think>y</think>x")
    url, handles = serve(model, tokenizer)
    session, client = open_session(url)
    # A tool result keeps the reasoning (it is no new query): chained. Each user turn strips it: a fork.
    agent(client, [{"role": "user", "content": "def f(x):"}], turns=3, max_tokens=7)
    records = post(url, session, "close").json()["records"]
    assert sorted(r["turns"] for r in records) == [1, 2] and {r["forks"] for r in records} == {1}
    assert all(r["token_exact_fraction"] == r["rerender_exact_fraction"] == 1.0 for r in records)
    check_branches(records, handles)
    fork = next(r for r in records if r["turns"] == 1)  # the re-render: earlier reasoning gone, its own kept
    assert fork["ids"].count(tokenizer.convert_tokens_to_ids("<think>")) == 1
    assert all(tokenizer.decode(h.result().ids) == "<think>y</think>xxxx" for h in handles)
