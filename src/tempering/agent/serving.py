"""What `tempering serve` runs behind its HTTP endpoints: one completion (`Job`) on the engine.

A `Job` is one choice of one request: its prompt ids and sampling settings (temperature, top-p, its own
seed, stop strings, how many alternatives' log-probs to report), submitted to the engine as a request
(`inference.protocol.Request`) whose token callback is the job's: the job collects the tokens and their
log-probs, decodes the text incrementally, cuts it at the first stop string (which ends the row), and
tells a streaming listener the text as it becomes final - text that might still turn out to begin a stop
string is held back until it cannot (`StopScan`, linear in the text whatever the stop strings' lengths), and
a partial UTF-8 character until it is whole or the job ends. The engine batches continuously: a job joins
the running rows at the next decode step, and leaves as soon as it is done or cancelled (`Job.cancel`, when
its client hangs up).
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from tempering.inference.protocol import Completion, Handle, Request
from tempering.inference.sampling import Sampled


def on_loop(future: Future, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """An asyncio future that completes with a job's `done` (set in the engine's thread). Unlike
    `asyncio.wrap_future`, cancelling it never cancels the job's own future under the engine."""
    out = loop.create_future()

    def copy(f) -> None:
        if out.done():
            return
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result())

    future.add_done_callback(lambda f: loop.call_soon_threadsafe(copy, f))
    return out


async def disconnected(request) -> None:
    """Returns when an ASGI request's client hangs up (after the body, the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Job:
    """One completion being generated (see the module docstring). The engine's thread writes it; the
    server's event loop reads it after `done` and may cancel it."""

    def __init__(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: list[str] = (),
        logprobs: int | None = None,
        client: str = "?",
    ):
        self.prompt, self.max_tokens, self.temperature, self.top_p = prompt, max_tokens, temperature, top_p
        self.seed, self.stop, self.logprobs, self.client = seed, [s for s in stop if s], logprobs, client
        self.ids: list[int] = []
        self.token_logprobs: list[TokenLogprob] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.completion: Completion | None = None
        """The engine's result (its ids, log-probs under the sampling distribution, policy version)."""
        self.done: Future = Future()
        self.handle: Handle | None = None
        self._cancel = threading.Event()
        self._listener: Callable[[str, list[TokenLogprob]], None] | None = None
        self._sent = 0  # characters of `text` a listener has heard
        self._reported = 0  # entries of `token_logprobs` a listener has heard
        self._decoded = (0, 0)  # (prefix, read) offsets of the incremental decoder
        self._stops: set[int] = set()
        self._scan = StopScan(self.stop) if self.stop else None
        self._tokenizer = None

    def listen(self, listener: Callable[[str, list[TokenLogprob]], None]) -> None:
        """Hear (text delta, log-prob entries since the last call) as the text becomes final. Listen before
        `submit`: a short job can be done before `submit` returns, and nothing is told twice."""
        self._listener = listener

    def cancel(self) -> None:
        """The client is gone: the row leaves the engine at its next step (a waiting one never runs)."""
        self._cancel.set()
        if self.handle is not None:
            self.handle.cancel()

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    def submit(self, engine) -> None:
        """Hand the job to the engine; `done` completes (with the job) when the engine is done with it."""
        self._tokenizer, self._stops = engine.tokenizer, set(engine.stop_ids)
        request = Request(
            self.prompt,
            self.max_tokens,
            self.temperature,
            self.top_p,
            self.seed,
            top_logprobs=0 if self.logprobs is None else max(1, self.logprobs),
            on_token=self._on_token,
            client=self.client,
        )
        self.handle = engine.submit(request)
        if self._cancel.is_set():
            self.handle.cancel()
        self.handle.future.add_done_callback(self._finished)

    # ----------------------------------------------------------------- in the engine's thread

    def _on_token(self, token: int, sampled: Sampled, row: int) -> bool:
        """Take the next token; True ends the row now (a stop string)."""
        self.ids.append(token)
        if token in self._stops:
            return False  # the engine ends the row; `_finished` closes the text
        if self.logprobs is not None:
            self.token_logprobs.append(
                TokenLogprob(token, float(sampled.raw[row]), sampled.top[row][: self.logprobs])
            )
        if self._listener is None and not self.stop:
            return False  # nobody reads the text before the end: it is decoded once then
        self._decode()
        if self._scan is not None and self._cut_at_stop():
            return True
        self._tell(final=False)
        return False

    def _finished(self, future: Future) -> None:
        if future.exception() is not None:
            self.done.set_exception(future.exception())
            return
        done: Completion = future.result()
        self.completion = done
        if self.finish_reason is None:
            self.finish_reason = done.finish_reason
            ended = done.finish_reason == "stop" and bool(self.ids) and self.ids[-1] in self._stops
            if self._listener is None and not self.stop:
                self.text = self._tokenizer.decode(
                    self.ids[:-1] if ended else self.ids, skip_special_tokens=False
                )
            else:  # what the incremental decoder still holds (a partial character: U+FFFD, as decoded whole)
                self._decode(len(self.ids) - ended, final=True)
                if self._scan is not None:
                    self._cut_at_stop()
        self._tell(final=True)
        self.done.set_result(self)

    def _decode(self, end: int | None = None, final: bool = False) -> None:
        """Incremental detokenization of the ids up to `end`: decode from a little before the new tokens,
        keep what is new once it is whole (a partial UTF-8 character decodes as U+FFFD and waits for the
        next token) or, `final`, as it is."""
        prefix, read = self._decoded
        ids = self.ids[prefix:end]
        before = self._tokenizer.decode(ids[: read - prefix], skip_special_tokens=False)
        now = self._tokenizer.decode(ids, skip_special_tokens=False)
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.text += now[len(before) :]
            self._decoded = (read, prefix + len(ids))

    def _cut_at_stop(self) -> bool:
        """Cut the text at the first stop string (it is not part of the answer) and finish with `stop`; True
        when one was found."""
        cut = self._scan.feed(self.text)
        if cut is None:
            return False
        self.text, self.finish_reason = self.text[:cut], "stop"
        return True

    def _tell(self, final: bool) -> None:
        if self._listener is None:
            return
        end = len(self.text)
        if not final and self._scan is not None:  # hold back a tail that could still become a stop string
            end -= self._scan.held
        delta, entries = self.text[self._sent : end], self.token_logprobs[self._reported :]
        if delta or entries:
            self._sent, self._reported = max(self._sent, end), len(self.token_logprobs)
            self._listener(delta, entries)


class StopScan:
    """Where the first of a few stop strings begins in a text that grows at its end, and how much of the
    text's end could still begin one (what a stream holds back). Knuth-Morris-Pratt: per stop string, the
    automaton's state - the longest of its prefixes that the text ends with - advances over each new
    character once, O(1) a character amortized whatever the stop strings' lengths. (Trying every prefix of
    every stop string on every token was O(L^2) a token: one 600,000-character stop stalled the engine,
    and every client with it, for seconds.)"""

    def __init__(self, stops: list[str]):
        self.stops, self.fallbacks = stops, [_fallback(s) for s in stops]
        self.states = [0] * len(stops)
        self.scanned = 0  # characters of the text seen so far

    @property
    def held(self) -> int:
        """Characters at the text's end that could still begin a stop string."""
        return max(self.states)

    def feed(self, text: str) -> int | None:
        """Advance over what `text` has past the characters seen so far; where the first stop string found
        begins (the earliest-beginning one where several end in the new text), or None."""
        first, new, start = None, text[self.scanned :], self.scanned
        for j, (stop, fallback) in enumerate(zip(self.stops, self.fallbacks)):
            k = self.states[j]
            for i, c in enumerate(new):
                while k and stop[k] != c:
                    k = fallback[k - 1]
                if stop[k] == c:
                    k += 1
                    if k == len(stop):
                        begin = start + i + 1 - k
                        first = begin if first is None else min(first, begin)
                        break
            self.states[j] = k
        self.scanned = len(text)
        return first


@functools.lru_cache(maxsize=64)  # a request's n choices (and a client's repeated requests) share one
def _fallback(stop: str) -> tuple[int, ...]:
    """KMP's failure function: entry i is the length of the longest proper prefix of stop[: i + 1] that
    is also a suffix of it."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character (printable Latin-1 as itself,
    the rest from U+0100 on, in byte order): that character -> its byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer, token: int) -> bytes:
    """A token's own bytes (OpenAI's `logprobs[].bytes`). A byte-level token may hold part of a UTF-8
    character, which `decode` shows as U+FFFD; its vocabulary entry keeps the bytes (byte-level BPE's
    alphabet, or SentencePiece's `<0xNN>` byte tokens). Other tokens: the bytes of their text."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        if all(c in BYTE_LEVEL for c in piece):
            raw = bytes(BYTE_LEVEL[c] for c in piece)
            if raw.decode("utf-8", "replace") == text:  # it was the byte-level spelling, not a word
                return raw
        if byte := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return bytes([int(byte[1], 16)])
    return text.encode("utf-8")
