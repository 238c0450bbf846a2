"""`tempering serve` on loopback (a real process started and stopped here): the OpenAI client, streaming,
batching, the agent as an HTTP client, /metrics, and its exposure rules."""

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tempering.agent.backends import local_model
from tempering.agent.repair import RepairSettings, repair
from tempering.cli import main as cli
from tempering.envs import EnvContext
from tempering.errors import TemperingError
from tempering.inference.engine import SamplingParams, make_engine
from tempering.models.loading import load_model, load_tokenizer
from tests.helpers.servers import free_port, start, stop

KEY = "k" * 24


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "requests.jsonl"
    proc, url = start(tiny_model_dir, "--log", str(log))
    yield url, log
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_lists_and_completes(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = [{"role": "user", "content": "def add(a, b):\n"}]
    a = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=16, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=16, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content  # greedy repeats
    assert a.choices[0].finish_reason in ("stop", "length") and 0 < a.usage.completion_tokens <= 16
    text = client.completions.create(model="tiny", prompt="def add(a, b):\n", max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 8


def test_streaming_gives_the_same_text_in_pieces(client):
    prompt = [{"role": "user", "content": "def mul(a, b):\n"}]
    whole = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=prompt, max_tokens=24, temperature=0, stream=True
        )
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_concurrent_requests_are_batched(server, client):
    url, _ = server
    prompt = [{"role": "user", "content": "def sub(a, b):\n"}]
    with ThreadPoolExecutor(8) as pool:
        outs = list(
            pool.map(
                lambda _: client.chat.completions.create(
                    model="tiny", messages=prompt, max_tokens=16, temperature=1.0
                ),
                range(16),
            )
        )
    assert all(o.usage.completion_tokens > 0 for o in outs)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    sizes = {
        s.labels["le"]: s.value
        for s in families["tempering_batch_size"].samples
        if s.name.endswith("_bucket")
    }
    total = next(s.value for s in families["tempering_batch_size"].samples if s.name.endswith("_count"))
    assert sizes["1.0"] < total  # some generations served more than one request


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="ending with a user turn"):
        client.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "def f(x): " * 300}]
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5
        )


def openai_error(response: httpx.Response, status: int) -> dict:
    """The response's error, checked to be OpenAI's shape: message, type, param, and a code that is a string
    or null (OpenAI's client reads `code` as a string)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def test_every_error_is_openai_shaped(server):
    url, _ = server
    ask = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert "Invalid URL" in openai_error(httpx.post(f"{url}/v1/embeddings", json=ask), 404)["message"]
    assert (
        openai_error(httpx.post(f"{url}/v1/chat/completions", json={**ask, "model": "gpt-4"}), 404)["code"]
        == "model_not_found"
    )
    wrong = httpx.get(f"{url}/v1/chat/completions")
    assert "POST" in wrong.headers["allow"] and "not allowed" in openai_error(wrong, 405)["message"]
    huge = httpx.post(
        f"{url}/v1/completions", content=b"x" * (3 << 20), headers={"content-type": "application/json"}
    )
    assert "over" in openai_error(huge, 413)["message"]
    assert (
        openai_error(httpx.post(f"{url}/v1/chat/completions", json={**ask, "max_tokens": 0}), 400)["param"]
        == "max_tokens"
    )


def test_null_is_the_default(client):
    """As at OpenAI: `"temperature": null` samples at 1, `"n": null` is one choice, and so on."""
    prompt = [{"role": "user", "content": "def add(a, b):\n"}]
    ok = client.chat.completions.create(
        model="tiny",
        messages=prompt,
        max_tokens=4,
        temperature=None,
        n=None,
        top_p=None,
        stream=None,
        stop=None,
        seed=3,
        extra_body={"logprobs": None},
    )
    default = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=4, seed=3)
    assert [c.message.content for c in ok.choices] == [c.message.content for c in default.choices]
    nulls = {"temperature": None, "n": None, "top_p": None, "return_token_ids": None, "top_k": None}
    assert (
        len(client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=nulls).choices) == 1
    )


def test_a_content_part_that_is_not_text_is_refused_by_name(client):
    prompt = [{"role": "user", "content": "def add(a, b):\n"}]
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    ]
    with pytest.raises(
        openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: a part of type 'image_url'"
    ):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2
        )
    texts = [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "\n"}]
    joined = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": texts}], max_tokens=8, temperature=0
    )
    plain = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=8, temperature=0)
    assert joined.choices[0].message.content == plain.choices[0].message.content


def test_logprobs_bytes_are_the_tokens_own(client):
    """The random tiny model samples byte tokens (part of a UTF-8 character): their `bytes` are that one
    byte, not the U+FFFD their text shows, and all the bytes together are the completion's."""
    prompt = [{"role": "user", "content": "def mul(a, b):\n"}]
    out = client.chat.completions.create(
        model="tiny", messages=prompt, max_tokens=32, temperature=1.0, seed=5, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", "replace") == out.choices[0].message.content
    assert any(len(c.bytes) == 1 and c.bytes[0] >= 0x80 for c in content)  # a byte token was sampled
    alternatives = [top for c in content for top in c.top_logprobs]
    assert all(entry.bytes != list("\ufffd".encode()) for entry in [*content, *alternatives])


@pytest.mark.parametrize(
    "option",
    [
        ["--max-batch", "0"],
        ["--port", "99999"],
        ["--port", "0"],
        ["--max-pending", "0"],
        ["--client-pending", "-1"],
        ["--max-n", "0"],
        ["--max-tokens-cap", "0"],
        ["--max-context", "0"],
        ["--threads", "0"],
        ["--alert-threshold", "1.5"],
        ["--alert-threshold", "nan"],
        ["--alert-window", "0"],
    ],
)
def test_an_out_of_range_serve_option_is_one_error_before_the_model_loads(option, tmp_path, capsys):
    """A missing model: any error about the model would mean the option was checked after it loaded."""
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, after its one line
        cli(["serve", str(tmp_path / "no-model"), *option])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and err[0].startswith("error: ") and option[1] in err[0] and "no-model" not in err[0]
    ), err


def test_an_engine_with_no_rows_to_generate_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="max_rows 0"):  # it would queue every request forever
        local_model(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), name="tiny", max_rows=0)


class Echo:
    """A request engine that is not a `LocalEngine` (no scheduler): it answers each request at once with
    the request's own last prompt tokens, then a stop token."""

    def __init__(self, tokenizer):
        self.tokenizer, self.stop_ids, self.started, self.closed = tokenizer, (tokenizer.eos_token_id,), 0, 0

    def submit(self, request):
        from tempering.inference.protocol import Completion, Handle

        handle = Handle(request)
        ids = [*request.prompt[-3:], self.stop_ids[0]]
        for token in ids:
            request.on_token(token, None, 0)
        handle.future.set_result(Completion(request.prompt, ids, [0.0] * len(ids), "stop", 0))
        return handle

    def start(self):
        self.started += 1

    def close(self):
        self.closed += 1


def test_serve_takes_any_engine_of_the_request_protocol(tiny_model_dir):
    from fastapi.testclient import TestClient

    from tempering.agent.backends import LocalModel
    from tempering.agent.server import create_app
    from tempering.inference.chat import chat_format

    tokenizer = load_tokenizer(tiny_model_dir)
    engine = Echo(tokenizer)
    chat = LocalModel("echo", engine, tokenizer, chat_format(tokenizer, "auto"), 64)
    with TestClient(create_app(chat)) as http:
        assert engine.started == 1
        reply = http.post(
            "/v1/completions", json={"model": "echo", "prompt": "def add(a, b):", "max_tokens": 8}
        )
        assert reply.status_code == 200, reply.text
        prompt = tokenizer("def add(a, b):", add_special_tokens=False).input_ids
        assert reply.json()["choices"][0]["text"] == tokenizer.decode(prompt[-3:])
        assert reply.json()["choices"][0]["finish_reason"] == "stop"
    assert engine.closed == 1


def test_a_port_in_use_is_one_error_before_the_model_loads(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli(["serve", str(tmp_path / "no-model"), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot listen on 127.0.0.1:") and "in use" in err and "\n" not in err, err


def test_stop_strings_cut_the_text_also_while_streaming(client):
    prompt = [{"role": "user", "content": "def add(a, b):\n"}]
    whole = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert len(text) > 6
    stop = text[3:6]  # a piece from the middle: everything from its first occurrence on is cut
    cut = client.chat.completions.create(
        model="tiny", messages=prompt, max_tokens=24, temperature=0, stop=[stop, "@@"]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert (
        cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < whole.usage.completion_tokens
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = client.completions.create(model="tiny", prompt="def add(a, b):\n", max_tokens=24, temperature=0)
    piece = plain.choices[0].text[2:5]
    cut = client.completions.create(
        model="tiny", prompt="def add(a, b):\n", max_tokens=24, temperature=0, stop=piece
    )
    assert cut.choices[0].text == plain.choices[0].text[: plain.choices[0].text.index(piece)]


def test_logprobs_are_the_models_own_with_the_top_alternatives(client, tiny_model_dir):
    import torch

    from tempering.inference.chat import chat_format

    messages = [{"role": "user", "content": "def sub(a, b):\n"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert 0 < len(content) <= out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the most likely
    # The same numbers from the model directly (log-softmax at temperature 1).
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    prompt = chat_format(tokenizer, "auto").render(messages)
    ids = (
        prompt + tokenizer(out.choices[0].message.content, add_special_tokens=False).input_ids[: len(content)]
    )
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    want = [float(logp[len(prompt) - 1 + k, ids[len(prompt) + k]]) for k in range(len(content))]
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-4)
    legacy = client.completions.create(
        model="tiny", prompt="def sub(a, b):\n", max_tokens=6, temperature=0, logprobs=2
    )
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_a_seeded_request_repeats_alone_and_inside_a_batch(client):
    prompt = [{"role": "user", "content": "def mod(a, b):\n"}]

    def ask(seed, n=1):
        return [
            c.message.content
            for c in client.chat.completions.create(
                model="tiny", messages=prompt, max_tokens=16, temperature=1.0, seed=seed, n=n
            ).choices
        ]

    first = ask(7)
    assert ask(7) == first and ask(8) != first
    with ThreadPoolExecutor(6) as pool:  # the seeded request shares a batch with others
        batched = list(pool.map(lambda s: ask(s), [7, 11, 12, 13, 14, 15]))
    assert batched[0] == first
    two = ask(7, n=2)
    assert len(two) == 2 and two[0] == first[0]  # choice i draws from seed + i


def test_fields_that_would_change_the_output_are_refused_by_name(client):
    prompt = [{"role": "user", "content": "x"}]
    for extra in [
        {"presence_penalty": 0.5},
        {"frequency_penalty": 1.0},
        {"logit_bias": {"5": 10}},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"top_k": 5},
    ]:
        with pytest.raises(openai.BadRequestError, match=f"'{next(iter(extra))}' is not supported"):
            client.chat.completions.create(model="tiny", messages=prompt, max_tokens=2, extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="'echo' is not supported"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, echo=True)
    ok = client.chat.completions.create(
        model="tiny",
        messages=prompt,
        max_tokens=2,
        presence_penalty=0,
        user="u",
        response_format={"type": "text"},
        metadata={"k": "v"},
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    usage = list(
        client.chat.completions.create(
            model="tiny", messages=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert usage[-1].usage is not None and usage[-1].usage.completion_tokens >= 1


def test_the_agent_over_http_matches_the_agent_in_process(server, tiny_model_dir, tasks, sandbox):
    """The same episodes over HTTP (token prompts, token ids back) as in process, attempt for attempt."""
    url, log = server
    heldout = tasks[1][:6]
    settings = RepairSettings(repairs=2)
    tokenizer, sampling = load_tokenizer(tiny_model_dir), SamplingParams(1.0, 1.0, 24)
    remote = repair(
        make_engine(f"{url}/v1", tokenizer, sampling, kind="http"),
        heldout,
        EnvContext(sandbox, feedback_chars=200),
        settings,
        max_context=180,
    )
    local = local_model(load_model(tiny_model_dir), tokenizer, sampling=sampling).engine
    here = repair(local, heldout, EnvContext(sandbox, feedback_chars=200), settings, max_context=180)
    assert [e.classes for e in remote.episodes] == [e.classes for e in here.episodes]
    assert sum(len(e.classes) for e in remote.episodes) > len(heldout)  # repairs were asked for over HTTP
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    served = sum(
        s.value
        for s in families["tempering_requests"].samples
        if s.name == "tempering_requests_total" and s.labels["endpoint"] == "/v1/completions"
    )
    assert served >= sum(len(e.classes) for e in remote.episodes)
    assert '"endpoint": "/v1/completions"' in log.read_text()  # one JSON line per request


def test_a_server_that_is_down_is_one_clear_error():
    with pytest.raises(TemperingError, match=r"model server at http://127.0.0.1:\d+/v1 is unreachable"):
        make_engine(f"http://127.0.0.1:{free_port()}/v1", None, kind="http")


def test_off_loopback_needs_a_token_and_a_token_is_enforced(tiny_model_dir):
    refused = subprocess.run(
        [sys.executable, "-m", "tempering.cli", "serve", str(tiny_model_dir), "--host", "192.0.2.1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("TEMPERING_SERVE")},
    )
    assert refused.returncode == 2 and "without a token" in refused.stderr
    proc, url = start(tiny_model_dir, env={"TEMPERING_SERVE_TOKEN": KEY})
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        refused = openai_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert refused["code"] == "invalid_api_key"
        with pytest.raises(TemperingError, match="refused the API key"):
            make_engine(f"{url}/v1", None, kind="http", api_key="wrong")
        assert (
            openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0).models.list().data[0].id == "tiny"
        )
    finally:
        stop(proc)
