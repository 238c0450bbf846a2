"""`agent/serving.py`: a `Job` driven token by token as the engine drives it (a stand-in engine, the tiny
model's real tokenizer): stop strings, what a stream holds back and flushes, and a token's own bytes."""

import random

import pytest

from tempering.agent.serving import Job, StopScan, token_bytes
from tempering.inference.protocol import Completion, Handle
from tempering.models.loading import load_tokenizer


class Engine:
    """What a `Job` uses of the engine: its tokenizer and stop ids, and `submit`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.stop_ids = tokenizer, (tokenizer.eos_token_id,)

    def submit(self, request):
        self.request, self.handle = request, Handle(request)
        return self.handle


def run(job: Job, tokenizer, ids: list[int], stream: bool) -> list[tuple[str, str]]:
    """Feed `ids` as the engine would (a row ends when the job says so); what a listener heard: each piece,
    with the job's text at the time."""
    heard: list[tuple[str, str]] = []
    if stream:
        job.listen(lambda delta, entries: heard.append((delta, job.text)))
    engine = Engine(tokenizer)
    job.submit(engine)
    reason = "length"
    for token in ids:
        if engine.request.on_token(token, None, 0):
            reason = "stop"
            break
        if token in engine.stop_ids:
            reason = "stop"
            break
    engine.handle.future.set_result(Completion(job.prompt, job.ids, [], reason, 0))
    assert job.done.result() is job
    return heard


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def held_back(text: str, stops: list[str]) -> int:
    """The slow reference: the longest end of `text` that begins some stop string (and is not all of it)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_the_stop_scan_matches_a_slow_reference_on_random_text():
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text, scan = "", StopScan(stops)
        while True:
            text += "".join(rng.choices("abc", k=rng.randint(1, 3)))  # a token's worth
            found = scan.feed(text)
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:  # the first stop string in the text so far, where it begins
                assert found == min(hits), (stops, text)
                break
            assert found is None and scan.held == held_back(text, stops), (stops, text)


def test_a_long_stop_string_that_the_text_keeps_almost_matching():
    """A 1024-character stop (the server's cap) over 10,000 characters that nearly match it all along:
    all but its last character held back throughout, found where it begins."""
    stop = "a" * 1023 + "b"
    scan, text = StopScan([stop]), ""
    for _ in range(5000):
        text += "aa"
        assert scan.feed(text) is None
    assert scan.held == 1023
    assert scan.feed(text + "b") == len(text) - 1023


@pytest.mark.parametrize("stream", [True, False])
def test_a_trailing_partial_character_is_flushed_at_the_end(tokenizer, stream):
    """A completion cut (max_tokens) in the middle of a UTF-8 character ends with U+FFFD, as the whole
    decode has it - streamed or not, with a stop string or without - and the stream is the text."""
    ids = tokenizer("x = '€'", add_special_tokens=False).input_ids
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    whole = tokenizer.decode(ids[:cut])
    for stop in ([], ["@@"]):
        job = Job([1], max_tokens=cut, stop=stop)
        heard = run(job, tokenizer, ids[:cut], stream)
        assert job.text == whole and job.finish_reason == "length"
        if stream:
            assert "".join(piece for piece, _ in heard) == whole


def test_a_stream_holds_back_exactly_what_could_begin_a_stop_string(tokenizer):
    ids = tokenizer("def add(a, b):\n    return a + b\n", add_special_tokens=False).input_ids
    stops = ["return a - b", "\n\n\n", "zz"]
    job = Job([1], max_tokens=len(ids), stop=stops)
    heard = run(job, tokenizer, ids, stream=True)
    assert job.text == tokenizer.decode(ids) == "".join(piece for piece, _ in heard)
    sent = ""
    for piece, text in heard[:-1]:  # the last one, at the end, holds nothing back
        sent += piece
        assert text.startswith(sent) and len(text) - len(sent) == held_back(text, stops), (sent, text)
    assert any(held_back(text, stops) > 1 for _, text in heard)  # "return a " waited for "+"
    job = Job([1], max_tokens=len(ids), stop=["a + b", "zz"])
    heard = run(job, tokenizer, ids, stream=True)
    assert job.text == "def add(a, b):\n    return " == "".join(piece for piece, _ in heard)
    assert job.finish_reason == "stop"


def test_a_tokens_bytes_are_its_own_not_its_texts_replacement_character(tokenizer):
    text = "naïve € ok"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces = [token_bytes(tokenizer, t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a byte token: part of a character
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()
