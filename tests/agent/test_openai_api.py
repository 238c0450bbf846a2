"""`agent/openai_api.py`: the checks made before a prompt is tokenized and the answers' shapes, without a
model or a server; and the size the server's modules keep (`agent/`: no function over 80 lines, no module
over 450)."""

import pytest

from tempering.agent.openai_api import (
    ChatReply,
    ChatRequest,
    CompletionReply,
    CompletionRequest,
    Refused,
    ServeLimits,
    check_request,
    request_messages,
    usage,
)
from tempering.agent.serving import Job, TokenLogprob


def chat(**fields) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def refusal(body, chars=2, top=None, limits=None, model="tiny", max_context=100) -> Refused:
    with pytest.raises(Refused) as caught:
        check_request(body, chars, top, model=model, max_context=max_context, limits=limits or ServeLimits())
    return caught.value


def test_check_request_returns_the_stop_strings():
    ok = dict(model="tiny", max_context=100, limits=ServeLimits())
    assert check_request(chat(stop="END"), 2, None, **ok) == ["END"]
    assert check_request(chat(stop=["a", "b"]), 2, None, **ok) == ["a", "b"]
    assert check_request(chat(), 2, None, **ok) == []


def test_check_request_refuses_by_name():
    assert (refusal(chat(model="other")).status, refusal(chat(model="other")).code) == (
        404,
        "model_not_found",
    )
    assert refusal(chat(logit_bias={"1": 5})).param == "logit_bias"
    assert refusal(chat(n=9)).param == "n"
    assert refusal(chat(max_tokens=101)).param == "max_tokens"  # the cap is the context unless set
    assert refusal(chat(max_tokens=11), limits=ServeLimits(max_tokens=10)).param == "max_tokens"
    assert refusal(chat(), top=6).param == "top_logprobs"
    assert refusal(chat(stop=list("abcde"))).param == "stop"
    assert "one has 1025" in refusal(chat(stop="x" * 1025)).message
    too_long = refusal(chat(), chars=100 * 16 + 1)
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")


def test_request_messages_refuses_a_part_that_is_not_text():
    given = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert request_messages(given) == [{"role": "user", "content": "ab"}]
    with pytest.raises(Refused) as caught:
        request_messages(
            [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url"}]}]
        )
    assert caught.value.param == "messages[1].content" and "image_url" in caught.value.message


def job(prompt: list[int], ids: list[int], text: str) -> Job:
    j = Job(prompt, max_tokens=8)
    j.ids, j.text, j.finish_reason = ids, text, "length"
    return j


def test_chat_reply_whole_and_chunks():
    reply = ChatReply("tiny", None)
    jobs = [job([1, 2, 3], [4, 5], "ab"), job([1, 2, 3], [6], "c")]
    whole = reply.whole(jobs)
    assert whole["id"].startswith("chatcmpl-") and whole["object"] == "chat.completion"
    assert [c["message"]["content"] for c in whole["choices"]] == ["ab", "c"]
    assert whole["usage"] == usage(jobs) == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert reply.chunk(0, "", [], None)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert reply.chunk(1, "x", [], None)["choices"][0]["delta"] == {"content": "x"}
    closing = reply.chunk(0, None, [], "stop")["choices"][0]
    assert closing["delta"] == {} and closing["finish_reason"] == "stop"
    assert reply.chunk(0, "x", [TokenLogprob(4, -0.5)], None)["choices"][0]["logprobs"] is None  # none asked


def test_chat_reply_logprobs_through_its_entry():
    reply = ChatReply("tiny", lambda e: {"token": str(e.token), "logprob": e.logprob})
    listed = reply.chunk(0, "x", [TokenLogprob(4, -0.5)], None)["choices"][0]["logprobs"]
    assert listed == {"content": [{"token": "4", "logprob": -0.5}]}


class Letters:
    """A stand-in tokenizer: token t is the letter 'a' + t."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t) for t in ids)


def test_completion_reply_logprobs_and_token_ids():
    body = CompletionRequest(prompt=[1, 2], logprobs=1, return_token_ids=True)
    reply = CompletionReply("tiny", Letters(), body.logprobs is not None, body.return_token_ids)
    j = job([1, 2], [0, 1], "ab")
    j.token_logprobs = [TokenLogprob(0, -0.1, [(0, -0.1)]), TokenLogprob(1, -0.2, [(2, -0.05)])]
    whole = reply.whole([j])
    assert whole["prompt_token_ids"] == [1, 2] and whole["choices"][0]["token_ids"] == [0, 1]
    assert whole["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"a": -0.1}, {"c": -0.05}],
        "text_offset": [0, 1],
    }
    plain = CompletionReply("tiny", Letters(), False, False)
    assert plain.whole([j])["choices"][0]["logprobs"] is None and "prompt_token_ids" not in plain.whole([j])
    assert plain.chunk(0, None, [], "length")["choices"][0] == {
        "index": 0,
        "text": "",
        "finish_reason": "length",
        "logprobs": None,
    }
