"""Recording sessions: `tempering serve --sessions` records what an agent's calls computed, for training.

`POST /v1/sessions` opens a session and gives its API key; each `/v1/chat/completions` or `/v1/completions`
call made with that key is a turn. The server computes the turn's prompt itself and records it: the prompt
ids the engine ran, the sampled ids with their log-probs (under the sampling distribution) and the policy
version. A call that repeats a recorded turn's prompt and answer and adds messages is chained onto it: the
recorded ids, then only the new messages tokenized (`chat_format.extend`) - sampled tokens are never
re-tokenized, so the trained sequence is token for token what the engine computed and sampled. Turns are
matched by the longest recorded prefix of canonical messages (role and text); a call that extends none (an
edited history, a second attempt from an earlier turn) starts a new branch and counts as a fork.

A branch (a path from a first turn to a leaf) becomes one `SessionRecord` when the session is closed:
its ids, a mask that is True on sampled tokens (tool results and user turns are observations), the
log-probs and versions, the reward attached to its last rewarded turn, the session's forks,
`token_exact_fraction` (of its turns, those it holds token for token as the engine computed and sampled
them) and `rerender_exact_fraction`: of its chat turns, those whose recorded prompt equals a fresh full
render of their messages - below 1 is what a re-rendering trainer would have trained on wrongly (the
record keeps the computed ids either way).

Guarded: the key is random, bound to its session, checked in constant time; a session holds at most
`max_tokens` recorded tokens (413 past it), one choice a call, and is dropped after `idle_s` without a
call; at most `max_sessions` are open (429). A retried call (the same prompt as the last turn, not yet
extended) replaces that turn rather than recording it twice; a cancelled or failed call, or one whose
result does not validate, records nothing.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from tempering.agent.openai_api import Refused
from tempering.agent.serving import Job
from tempering.inference.chat import Conversation
from tempering.inference.generation import encode_prompt

KEY_PREFIX = "tps-"
RATE_LIMITED = ("rate_limit_exceeded", "rate_limit_error", {"Retry-After": "1"})
Key = tuple | str
"""What a call sent, comparable by prefix: canonical messages ((role, text), ...), a text, or token ids."""


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 64
    """Sessions open at once; more get 429."""
    max_tokens: int = 65536
    """Tokens a session may record (prompts' new tokens and sampled ones, all turns); past it, 413."""
    idle_s: float = 900.0
    """A session without a call for this long is dropped, its turns with it."""


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    reward: float = Field(allow_inf_nan=False)
    """The reward (a finite number)."""
    turn: int | None = None
    """Which recorded turn (0 = the first); unset: the last."""


@dataclass
class Turn:
    key: Key
    reply: Key
    """What a next call repeats of this turn's answer (the assistant message, the text, the ids)."""
    parent: int | None
    prompt: list[int]
    """The ids the engine computed: the parent's prompt and sampled ids, then the new tokens."""
    ids: list[int]
    logprobs: list[float]
    version: int
    messages: list[dict[str, str]] | None = None
    reward: float | None = None
    children: int = 0


@dataclass
class SessionRecord:
    """One branch of a finished session, as a trainer takes it (the `Trajectory` of a recorded agent)."""

    session: str
    ids: list[int]
    mask: list[bool]
    """True on the tokens the model sampled (they carry the loss); False on prompts and observations."""
    logprobs: list[float]
    """The sampled tokens' log-probs under the sampling distribution; 0.0 where the mask is False."""
    versions: list[int]
    """The policy version that sampled each token; -1 where the mask is False."""
    reward: float | None
    forks: int
    """Calls of the session that extended no recorded turn's leaf (new branches)."""
    turns: int
    texts: list[str]
    """Each turn's reply as the agent received it (text), in order."""
    ends: list[int]
    """Each turn's last sampled token: its index in `ids`."""
    token_exact_fraction: float
    """Of the branch's turns, those the record holds token for token as the engine computed them (the
    prompt it ran, then the ids it sampled): 1.0 unless the chaining is broken."""
    rerender_exact_fraction: float | None
    """Of the branch's chat turns, those whose prompt equals a full re-render of their messages (below 1: what
    a trainer re-rendering the conversation would have trained on wrongly)."""


@dataclass(frozen=True)
class Sampling:
    """What a trainer's session samples with, whatever its agent asks: the recorded log-probs must be those of
    the distribution the trainer computes (its temperature and top-p), and each call's seed comes from the
    session's, so a rerun samples the same."""

    temperature: float
    top_p: float
    max_tokens: int
    """The most tokens one call may write (a call asking for more gets this many)."""
    seed: int


@dataclass
class Session:
    id: str
    secret: str
    touched: float
    sampling: Sampling | None = None
    """Set by a trainer that opens the session itself (`agent.episodes`); None: the call's own settings."""
    turns: list[Turn] = field(default_factory=list)
    calls: int = 0
    """Calls admitted so far (the next call's seed is the session's plus this)."""
    forks: int = 0
    tokens: int = 0
    rejected: int = 0
    """Results that failed validation (never recorded)."""

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}{self.id}-{self.secret}"


@dataclass
class Call:
    """One call of a session: how its prompt is computed (off the event loop) and, when done, recorded."""

    store: SessionStore
    session: Session
    key: Key
    tokens: Callable[[], list[int]]
    """The prompt as a call outside a session would compute it (a full render)."""
    messages: list[dict[str, str]] | None = None
    index: int = 0
    """The call's place among its session's calls."""
    parent: int | None = None
    replaces: int | None = None
    prompt: list[int] = field(default_factory=list)
    new_tokens: int = 0

    @property
    def client(self) -> str:
        """Whose room the call takes in the server's admission: the session's, not its address's."""
        return f"session {self.session.id}"

    def sampled(self, temperature: float, top_p: float, max_tokens: int, seed: int) -> tuple:
        """(temperature, top_p, max_tokens, seed) of the call: its own, or its trainer's session's."""
        s = self.session.sampling
        if s is None:
            return temperature, top_p, max_tokens, seed
        return s.temperature, s.top_p, min(max_tokens, s.max_tokens), (s.seed + self.index) % (1 << 62)

    def tokenize(self) -> list[int]:
        self.prompt = self.store.prompt(self)
        return self.prompt

    def watch(self, job: Job) -> None:
        job.done.add_done_callback(lambda f: f.exception() is None and self.store.record(self, job))


class SessionStore:
    """The open sessions and the finished records (`take_finished`); thread-safe (calls are recorded in the
    engine's thread)."""

    def __init__(
        self, chat, limits: SessionLimits | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.chat, self.limits, self.clock = chat, limits or SessionLimits(), clock
        self.lock = threading.Lock()
        self.open: dict[str, Session] = {}
        self.finished: list[SessionRecord] = []
        self.expired = 0

    # Sessions and their keys.

    def create(self, sampling: Sampling | None = None) -> Session:
        with self.lock:
            self._expire()
            if len(self.open) >= self.limits.max_sessions:
                raise Refused(429, f"at most {self.limits.max_sessions} sessions open at once", *RATE_LIMITED)
            session = Session(secrets.token_hex(8), secrets.token_urlsafe(24), self.clock(), sampling)
            self.open[session.id] = session
            return session

    def authorize(self, key: str) -> Session:
        """The session `key` belongs to (401 for a wrong, forged or expired one)."""
        sid, _, secret = key.removeprefix(KEY_PREFIX).partition("-")
        with self.lock:
            self._expire()
            session = self.open.get(sid)
        expected = session.secret if session else secrets.token_urlsafe(24)
        if not hmac.compare_digest(secret.encode(), expected.encode()) or session is None:
            raise Refused(401, "wrong or expired session key", "invalid_api_key", "authentication_error")
        session.touched = self.clock()
        return session

    def owned(self, sid: str, key: str) -> Session:
        """Session `sid`, for a caller holding its key (404 unknown or expired, 401 another key)."""
        with self.lock:
            self._expire()
            known = sid in self.open
        if not known:
            raise Refused(
                404, f"no open session '{sid}' (closed, expired or never opened)", "session_not_found"
            )
        session = self.authorize(key)
        if session.id != sid:
            raise Refused(
                401, "this key belongs to another session", "invalid_api_key", "authentication_error"
            )
        return session

    def accepts(self, path: str, key: str) -> bool:
        """For the server's token guard: a session key may call the completions and its own session."""
        if not key.startswith(KEY_PREFIX):
            return False
        sid = key.removeprefix(KEY_PREFIX).partition("-")[0]
        return path in ("/v1/chat/completions", "/v1/completions") or path.startswith(f"/v1/sessions/{sid}/")

    def _expire(self) -> None:
        now = self.clock()
        for sid in [s.id for s in self.open.values() if now - s.touched > self.limits.idle_s]:
            del self.open[sid]
            self.expired += 1

    # Calls.

    def call(
        self, session: Session, key: Key, n: int, tokens: Callable[[], list[int]], messages=None
    ) -> Call:
        if n != 1:
            raise Refused(400, "n: a session records one choice per call", param="n")
        with self.lock:
            session.calls += 1
        return Call(self, session, key, tokens, messages, index=session.calls - 1)

    def prompt(self, call: Call) -> list[int]:
        """The call's prompt ids: chained onto the turn it extends, else a full render (a new branch)."""
        with self.lock:
            turns = list(call.session.turns)
        last = len(turns) - 1
        if turns and turns[last].key == call.key and not turns[last].children:  # a retry
            call.parent, call.replaces, ids = turns[last].parent, last, list(turns[last].prompt)
        elif (found := _longest_prefix(turns, call.key)) is not None:
            ids = self._extended(turns[found], call)
            call.parent = None if ids is None else found  # re-rendered history: a new branch, never merged
        else:
            ids = None
        ids = call.tokens() if ids is None else ids
        parent = turns[call.parent] if call.parent is not None else None
        call.new_tokens = len(ids) - (len(parent.prompt) + len(parent.ids) if parent else 0)
        if call.replaces is None and call.session.tokens + call.new_tokens > self.limits.max_tokens:
            raise Refused(413, f"the session is over its budget of {self.limits.max_tokens} tokens")
        return ids

    def _extended(self, turn: Turn, call: Call) -> list[int] | None:
        """The turn's ids, its sampled ids, then the call's new part tokenized alone (None: a chat template
        that re-renders earlier turns, so the call is a new branch)."""
        full, rest = turn.prompt + turn.ids, call.key[len(turn.key) + len(turn.reply) :]
        if isinstance(rest, str):
            return full + self.chat.tokenizer(rest, add_special_tokens=False).input_ids
        if turn.messages is None:
            return full + list(rest)
        ended = bool(turn.ids) and turn.ids[-1] in self.chat.engine.stop_ids
        try:
            conv = Conversation([dict(m) for m in turn.messages])
            return full + self.chat.format.extend(
                conv, turn.reply[0][1], ended, call.messages[len(conv.messages) + 1 :]
            )
        except ValueError:
            return None

    def record(self, call: Call, job: Job) -> None:
        """A finished call's turn, validated (never a partial or empty one)."""
        done, session = job.completion, call.session
        valid = (
            done is not None
            and done.finish_reason != "cancelled"
            and done.prompt == call.prompt
            and len(done.ids) == len(done.logprobs) > 0
            and isinstance(done.version, int)
            and done.version >= 0
        )
        with self.lock:
            if session.id not in self.open:
                return  # closed or expired meanwhile: nothing of it is kept
            if not valid:
                session.rejected += 1
                return
            turn = Turn(
                call.key,
                _reply(call, job),
                call.parent,
                list(done.prompt),
                list(done.ids),
                list(done.logprobs),
                done.version,
                call.messages,
            )
            if call.replaces is not None and not session.turns[call.replaces].children:
                session.turns[call.replaces] = turn
                return  # (one that a call extended meanwhile stays: the retry becomes its sibling)
            parent = session.turns[call.parent] if call.parent is not None else None
            session.forks += (parent.children > 0) if parent else bool(session.turns)
            if parent:
                parent.children += 1
            session.turns.append(turn)
            session.tokens += call.new_tokens + len(done.ids)
            session.touched = self.clock()

    # Rewards and records.

    def reward(self, session: Session, reward: float, turn: int | None = None) -> dict:
        with self.lock:
            if not session.turns:
                raise Refused(400, "the session has no recorded turn to reward yet")
            index = len(session.turns) - 1 if turn is None else turn
            if not 0 <= index < len(session.turns):
                raise Refused(
                    400, f"turn: {turn} is not one of the {len(session.turns)} recorded", param="turn"
                )
            session.turns[index].reward = reward
        return {"id": session.id, "turn": index, "reward": reward}

    def close(self, session: Session) -> list[SessionRecord]:
        """Ends the session: its branches as records, also kept for `take_finished`."""
        with self.lock:
            if self.open.pop(session.id, None) is None:
                return []
        records = [self._branch(session, leaf) for leaf in _leaves(session.turns)]
        with self.lock:
            self.finished += records
        return records

    def collect(self, session: Session) -> list[SessionRecord]:
        """Ends the session if it is open; its records either way, taken out of `take_finished`'s (the
        trainer's side, when it opened the session itself)."""
        self.close(session)
        with self.lock:
            mine = [r for r in self.finished if r.session == session.id]
            self.finished = [r for r in self.finished if r.session != session.id]
        return mine

    def take_finished(self) -> list[SessionRecord]:
        """The records of the sessions closed since the last call (the trainer's side)."""
        with self.lock:
            out, self.finished = self.finished, []
        return out

    def _text(self, turn: Turn) -> str:
        """The reply's text: the assistant message, the completion's text, or its ids decoded."""
        if isinstance(turn.reply, str):
            return turn.reply
        return turn.reply[0][1] if turn.messages is not None else self.chat.tokenizer.decode(turn.ids)

    def _branch(self, session: Session, leaf: int) -> SessionRecord:
        path, at = [], leaf
        while at is not None:
            path.append(session.turns[at])
            at = session.turns[at].parent
        path.reverse()
        last = path[-1]
        ids = last.prompt + last.ids
        mask, logprobs, versions = [False] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        ends = [len(t.prompt) + len(t.ids) - 1 for t in path]
        for t in path:
            start = len(t.prompt)
            span = range(start, start + len(t.ids))
            for i, lp in zip(span, t.logprobs):
                mask[i], logprobs[i], versions[i] = True, lp, t.version
        rewards = [t.reward for t in path if t.reward is not None]
        texts = [self._text(t) for t in path]
        chats = [t for t in path if t.messages is not None]
        rerender = (
            sum(self.chat.render(t.messages) == t.prompt for t in chats) / len(chats) if chats else None
        )
        held = [ids[: len(t.prompt) + len(t.ids)] == t.prompt + t.ids for t in path]
        return SessionRecord(
            session.id,
            ids,
            mask,
            logprobs,
            versions,
            rewards[-1] if rewards else None,
            session.forks,
            len(path),
            texts,
            ends,
            sum(held) / len(held),
            rerender,
        )


def chat_key(messages: list[dict[str, str]]) -> tuple:
    """Canonical messages: (role, text) pairs, what the chat format renders."""
    return tuple((m["role"], m["content"]) for m in messages)


def text_prompt(tokenizer, prompt: str | list[int]) -> tuple[Key, Callable[[], list[int]]]:
    """A completions call's key and its full tokenization."""
    if isinstance(prompt, str):
        return prompt, lambda: encode_prompt(tokenizer, prompt)
    return tuple(prompt), lambda: list(prompt)


def _reply(call: Call, job: Job) -> Key:
    if call.messages is not None:
        return (("assistant", job.text),)
    return job.text if isinstance(call.key, str) else tuple(job.completion.ids)


def _longest_prefix(turns: list[Turn], key: Key) -> int | None:
    """The turn whose prompt and answer are the longest proper prefix of `key`, or None."""
    best, length = None, -1
    for i, t in enumerate(turns):
        full = t.key + t.reply if type(t.key) is type(key) else None
        if full is not None and len(key) > len(full) > length and key[: len(full)] == full:
            best, length = i, len(full)
    return best


def _leaves(turns: list[Turn]) -> list[int]:
    return [i for i, t in enumerate(turns) if t.children == 0]
