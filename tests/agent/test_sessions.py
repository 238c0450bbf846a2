"""Recording sessions in `tempering serve` (in-process on loopback): a multi-turn agent's calls recorded
token for token as the engine computed and sampled them (chat with a tool result, streaming or not, and
text completions), rewards, forks on an edited history, token exactness against a full re-render, and a
hostile agent (wrong or forged keys, floods, huge messages, a session never closed) that costs nothing
but its own session."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tempering.agent.backends import local_model
from tempering.agent.openai_api import Refused
from tempering.agent.server import ServeLimits
from tempering.agent.sessions import SessionLimits
from tempering.models.loading import load_model, load_tokenizer
from tests.helpers.sessions import agent, chatml, check_computed, open_session, post, serving


@pytest.fixture()
def serve():
    yield from serving()


def test_a_multi_turn_session_with_a_tool_result_is_recorded_as_computed(serve, tiny_model_dir):
    model, tokenizer = chatml(tiny_model_dir)
    url, handles = serve(model, tokenizer)
    session, client = open_session(url)
    start = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "def add(a, b):"}]
    messages = agent(client, start, turns=3, streamed={1})
    messages.append({"role": "user", "content": "and?"})  # two new messages after the last answer
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert post(url, session, "reward", reward=0.5, turn=1).json()["turn"] == 1
    assert post(url, session, "reward", reward=1.0).json() == {"id": session["id"], "turn": 3, "reward": 1.0}
    (record,) = post(url, session, "close").json()["records"]
    assert (record["turns"], record["forks"], record["reward"]) == (4, 0, 1.0)
    check_computed(record, handles)
    # Only the new messages were tokenized: the re-render of each call's messages is a different check,
    # and the fraction is what it says (sampled byte tokens of a random model re-tokenize differently).
    prompts = [messages[: 2 + 2 * k] for k in range(3)] + [messages]
    rendered = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
    fresh = [tokenizer(t, add_special_tokens=False).input_ids for t in rendered]
    agree = sum(f == h.result().prompt for f, h in zip(fresh, handles))
    assert record["rerender_exact_fraction"] == pytest.approx(agree / 4)
    assert record["token_exact_fraction"] == 1.0
    assert post(url, session, "reward", reward=1.0).status_code == 404  # closed


def test_a_stable_reply_is_token_exact_and_an_edited_history_is_a_fork(serve, tiny_model_dir):
    model, tokenizer = chatml(tiny_model_dir, stable=True)
    url, handles = serve(model, tokenizer)
    session, client = open_session(url)
    start = [{"role": "user", "content": "def add(a, b):"}]
    messages = agent(client, start, turns=3, streamed={0, 2})
    agent(client, messages[:5], turns=1)  # a retry of the last call: recorded once
    edited = [*messages[:1], {"role": "assistant", "content": "return a + b"}, *messages[2:]]
    agent(client, edited, turns=1)
    records = post(url, session, "close").json()["records"]
    assert sorted(r["turns"] for r in records) == [1, 3] and {r["forks"] for r in records} == {1}
    assert all(r["token_exact_fraction"] == r["rerender_exact_fraction"] == 1.0 for r in records)
    long = next(r for r in records if r["turns"] == 3)
    assert len(handles) == 5 and long["ids"] == handles[3].result().prompt + handles[3].result().ids


def test_text_completions_chain_on_a_plain_model(serve, tiny_model_dir):
    url, handles = serve(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir))
    session, client = open_session(url)
    prompt = "def add(a, b):\n"
    for _ in range(3):
        prompt += client.completions.create(model="tiny", prompt=prompt, max_tokens=6).choices[0].text + "\n#"
    (record,) = post(url, session, "close").json()["records"]
    assert (record["turns"], record["forks"], record["rerender_exact_fraction"]) == (3, 0, None)
    assert record["token_exact_fraction"] == 1.0
    check_computed(record, handles)


def test_hostile_agents_get_http_errors_and_cost_only_their_own_session(serve, tiny_model_dir):
    limits = ServeLimits(client_pending=2, max_request_bytes=1 << 16)
    sessions = SessionLimits(max_sessions=3, max_tokens=100, idle_s=1.5)
    url, handles = serve(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), sessions, limits, 0.02)
    good, good_client = open_session(url)
    bad, bad_client = open_session(url)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=8)
    forged = f"tps-{good['id']}-{'x' * 32}"
    for key in ("nonsense", forged, bad["api_key"]):  # another session's key never writes to this one
        assert post(url, good, "reward", key=key, reward=1.0).status_code == 401
    assert (
        httpx.post(
            f"{url}/v1/chat/completions", json=ask, headers={"Authorization": f"Bearer {forged}"}
        ).status_code
        == 401
    )
    assert httpx.post(f"{url}/v1/sessions/nope/close").status_code == 404
    with ThreadPoolExecutor(12) as pool:  # a flood from one session, and one honest call beside it
        flood = [
            pool.submit(bad_client.with_options(max_retries=0).chat.completions.create, **ask)
            for _ in range(10)
        ]
        honest = good_client.chat.completions.create(**ask)
    errors = [f.exception() for f in flood]
    assert (
        any(isinstance(e, openai.RateLimitError) for e in errors)
        and honest.choices[0].message.content is not None
    )
    huge = dict(ask, messages=[{"role": "user", "content": "x" * (1 << 17)}])
    with pytest.raises(openai.APIStatusError) as refused:
        bad_client.chat.completions.create(**huge)
    assert refused.value.status_code == 413
    long = dict(ask, messages=[{"role": "user", "content": "def f(x): " * 60}], max_tokens=1)
    with pytest.raises(openai.APIStatusError) as over:  # past the session's token budget
        bad_client.chat.completions.create(**long)
    assert over.value.status_code == 413
    extra = open_session(url)[0]
    assert httpx.post(f"{url}/v1/sessions").status_code == 429  # max_sessions
    for _ in range(2):  # `bad` and `extra` go idle; `good` calls (the same prompt: a retry, recorded once)
        time.sleep(0.9)
        good_client.chat.completions.create(**ask)
    assert post(url, bad, "close").status_code == 404 and post(url, extra, "close").status_code == 404
    with pytest.raises(openai.AuthenticationError):
        bad_client.chat.completions.create(**ask)
    (record,) = post(url, good, "close").json()["records"]
    assert (record["turns"], record["forks"]) == (1, 0)
    assert record["ids"] == handles[-1].result().prompt + handles[-1].result().ids


def test_behind_the_server_token_a_session_key_reaches_only_the_completions_and_its_session(
    serve, tiny_model_dir
):
    token = "t" * 32
    url, _ = serve(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), token=token)
    assert httpx.post(f"{url}/v1/sessions").status_code == 401
    session = httpx.post(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {token}"}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    key = {"Authorization": f"Bearer {session['api_key']}"}
    assert httpx.post(f"{url}/v1/sessions", headers=key).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=key).status_code == 401
    assert post(url, session, "close").json()["records"][0]["turns"] == 1


def test_without_sessions_the_routes_say_so(tiny_model_dir):
    from tempering.agent.server import OpenAIServer

    chat = local_model(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), name="tiny")
    with pytest.raises(Refused, match="--sessions") as refused:
        OpenAIServer(chat).store()
    assert refused.value.status == 404
