"""Recording sessions from tests: a tiny model with ChatML (optionally a head whose replies re-tokenize to
themselves), a `tempering serve` with sessions on loopback, a scripted agent, and the check that a record
is what the engine computed and sampled."""

import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from tempering.agent.backends import local_model
from tempering.agent.server import ServeLimits, create_app
from tempering.agent.sessions import SessionLimits
from tempering.models.loading import load_model, load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml(model_dir, stable: bool = False):
    """The tiny model with ChatML's special tokens and template; `stable`: a head that always writes one
    token whose repetitions re-tokenize to themselves, so a re-render of its replies is exact."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    if stable:
        token = stable_token(tokenizer)
        head = torch.nn.Linear(model.config.hidden_size, len(tokenizer), bias=True)
        torch.nn.init.zeros_(head.weight)
        with torch.no_grad():
            head.bias.fill_(-10.0)
            head.bias[token] = 10.0
        model.lm_head = head
    return model, tokenizer


def stable_token(tokenizer) -> int:
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    for c in "xyzqjkvwXYZQ;:@$":
        ids = encode(c)
        if len(ids) == 1 and encode("assistant\n" + c * 8) == encode("assistant\n") + ids * 8:
            return ids[0]
    raise AssertionError("no token of this tokenizer re-tokenizes to itself")


def serving():
    """The `serve` fixture's body: serve(model, tokenizer, sessions=..., limits=..., step_s=...) -> (url, the
    engine's handles); the servers stop when the test ends."""
    servers = []

    def start(model, tokenizer, sessions=None, limits=None, step_s=0.0, token=None):
        chat = local_model(model, tokenizer, name="tiny")
        handles, submit = [], chat.engine.submit
        chat.engine.submit = lambda request: handles.append(submit(request)) or handles[-1]
        if step_s:
            forward = chat.engine.scheduler._forward
            chat.engine.scheduler._forward = lambda *a, **k: time.sleep(step_s) or forward(*a, **k)
        app = create_app(
            chat, sessions=sessions or SessionLimits(), limits=limits or ServeLimits(), token=token
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        servers.append(server)
        return url, handles

    yield start
    for server in servers:
        server.should_exit = True


def open_session(url: str) -> tuple[dict, openai.OpenAI]:
    session = httpx.post(f"{url}/v1/sessions").json()
    return session, openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def post(url: str, session: dict, what: str, key: str | None = None, **body) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key or session['api_key']}"}
    return httpx.post(f"{url}/v1/sessions/{session['id']}/{what}", json=body, headers=auth)


def agent(client, messages, turns: int, streamed=(), max_tokens=8) -> list[dict]:
    """A scripted agent: each answer, then a tool result (first) or a user turn; some turns streamed."""
    for turn in range(turns):
        ask = dict(model="tiny", messages=messages, max_tokens=max_tokens, stream=turn in streamed)
        reply = client.chat.completions.create(**ask)
        if turn in streamed:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            text = reply.choices[0].message.content
        role = "tool" if turn == 0 else "user"
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": role, "content": f"ok {turn}"},
        ]
    return messages


def check_computed(record: dict, handles) -> None:
    """The record is what the engine computed and sampled: the last call's prompt and sampled ids, the
    mask on every call's sampled span with its log-probs and version, nothing else."""
    done = [h.result() for h in handles]
    assert record["ids"] == done[-1].prompt + done[-1].ids
    sampled = {}
    for c in done:
        assert record["ids"][: len(c.prompt) + len(c.ids)] == c.prompt + c.ids  # each call's context
        sampled |= {len(c.prompt) + i: (lp, c.version) for i, lp in enumerate(c.logprobs)}
    assert [i for i, m in enumerate(record["mask"]) if m] == sorted(sampled)
    for i, (lp, version) in sampled.items():
        assert record["logprobs"][i] == pytest.approx(lp) and record["versions"][i] == version
    assert all(v == -1 for v, m in zip(record["versions"], record["mask"]) if not m)
