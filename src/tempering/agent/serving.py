"""What `tempering serve` runs behind its HTTP endpoints: one generation request (`Job`) and the `Batcher`.

A `Job` is one completion: its prompt ids and sampling settings (temperature, top-p, its own seed, stop
strings, how many alternatives' log-probs to report), and what it has produced so far - the tokens, their
log-probs, and the text, decoded incrementally and cut at the first stop string. A streaming request
hears the text as it becomes final (`Job.listen`): text that might still turn out to begin a stop string
is held back until it cannot.

The `Batcher` admits jobs (per client and in all, `sandbox.app.Admission`: past a cap, 429), and one
background thread generates them: each batch takes the queued jobs (up to `max_batch`), each row with its
own sampling settings and generator, and ends a row as soon as its job is done - its max_tokens reached,
a stop string written, or its client gone (`Job.cancel`): the row leaves the batch and the KV cache at
the next decode step. A job cancelled while queued never runs. (Static batching: a job that arrives during
a batch waits for the next one.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tempering.rollout.generate import RowSampling, TokenStep


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Job:
    """One completion being generated (see the module docstring). Thread-safe where it must be: the
    batcher thread writes it, the server's event loop reads it after `done` and cancels it."""

    def __init__(self, prompt: list[int], *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0, stop: list[str] = (), logprobs: int | None = None, client: str = "?"):
        self.prompt, self.max_tokens, self.temperature, self.top_p = prompt, max_tokens, temperature, top_p
        self.seed, self.stop, self.logprobs, self.client = seed, [s for s in stop if s], logprobs, client
        self.ids: list[int] = []
        self.token_logprobs: list[TokenLogprob] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.done: Future = Future()
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._listener: Callable[[str, list[TokenLogprob]], None] | None = None
        self._sent = 0           # characters of `text` a listener has heard
        self._reported = 0       # entries of `token_logprobs` a listener has heard
        self._decoded = (0, 0)   # (prefix, read) offsets of the incremental decoder

    def listen(self, listener: Callable[[str, list[TokenLogprob]], None]) -> None:
        """Hear (text delta, log-prob entries since the last call) as the text becomes final."""
        self._listener = listener

    def cancel(self) -> None:
        """The client is gone: a queued job is done now (never runs), a running one leaves its batch at the
        next decode step."""
        with self._lock:
            self.cancelled.set()
            if not self._started and not self.done.done():
                self.done.set_result(None)

    def start(self) -> bool:
        """The batcher takes the job; False when it was cancelled first."""
        with self._lock:
            self._started = not self.done.done()
            return self._started

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    # -------------------------------------------------------------------- in the batcher thread

    def add(self, tokenizer, token: int, logprob: float, top: list[tuple[int, float]] | None,
            stops: set[int]) -> bool:
        """Take the next sampled token; True when the job is done (it then must leave the batch)."""
        self.ids.append(token)
        if token in stops:
            return self._finish("stop", tokenizer)
        if self.logprobs is not None:
            self.token_logprobs.append(TokenLogprob(token, logprob, (top or [])[: self.logprobs]))
        if self._listener is None and not self.stop:  # nobody reads the text before the end: decode it once then
            return len(self.ids) >= self.max_tokens and self._finish("length", tokenizer)
        seen = len(self.text)
        self._decode(tokenizer)
        if self.stop and self._cut_at_stop(seen):
            return self._finish("stop")
        if len(self.ids) >= self.max_tokens:
            return self._finish("length")
        self._tell(final=False)
        return False

    def _decode(self, tokenizer) -> None:
        """Incremental detokenization: decode from a little before the new tokens, keep what is new once it
        is whole (a partial UTF-8 character decodes as U+FFFD and waits for the next token)."""
        prefix, read = self._decoded
        ids = self.ids[prefix:]
        before = tokenizer.decode(ids[: read - prefix], skip_special_tokens=False)
        now = tokenizer.decode(ids, skip_special_tokens=False)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._decoded = (read, len(self.ids))

    def _cut_at_stop(self, seen: int) -> bool:
        """Cut the text at the first stop string (it is not part of the answer); True when one was found.
        Only a stop string that ends in the new text (after the first `seen` characters) can be new."""
        start = max(0, seen - max(map(len, self.stop)) + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _finish(self, reason: str, tokenizer=None) -> bool:
        """Done; with `tokenizer`, the text is decoded whole now (unless it was decoded as it came)."""
        if tokenizer is not None and self._listener is None and not self.stop:
            ended = bool(self.ids) and reason == "stop"
            self.text = tokenizer.decode(self.ids[:-1] if ended else self.ids, skip_special_tokens=False)
        self.finish_reason = reason
        self._tell(final=True)
        return True

    def _tell(self, final: bool) -> None:
        if self._listener is None:
            return
        end = len(self.text)
        if not final:  # hold back a tail that could still become a stop string
            end -= max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if self.text.endswith(s[:k])),
                       default=0)
        delta, entries = self.text[self._sent: end], self.token_logprobs[self._reported:]
        if delta or entries:
            self._sent, self._reported = max(self._sent, end), len(self.token_logprobs)
            self._listener(delta, entries)


class Batcher:
    """Admits jobs and generates them in batches in one background thread (see the module docstring)."""

    def __init__(self, engine, tokenizer, admission, *, max_batch: int = 32,
                 on_batch: Callable[[int], None] | None = None):
        self.engine, self.tokenizer, self.admission, self.max_batch = engine, tokenizer, admission, max_batch
        self.on_batch = on_batch or (lambda n: None)
        self.stops = set(engine.stop_ids)
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self.thread.start()

    def admit(self, client: str, n: int) -> None:
        """Hold room for `n` jobs of `client` (HTTPException 429 or 413 past the caps)."""
        self.admission.enter(client, n)

    def release(self, client: str, n: int) -> None:
        """Give back room admitted for jobs that will not be queued after all."""
        self.admission.leave(client, n)

    def enqueue(self, jobs: list[Job]) -> None:
        """Queue admitted jobs; each gives its room back when it is done (or cancelled)."""
        for job in jobs:
            job.done.add_done_callback(lambda _, c=job.client: self.admission.leave(c, 1))
            self.queue.put(job)

    @property
    def pending(self) -> int:
        return self.admission.total

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while (first := self.queue.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self.queue.put(None)
                    break
                batch.append(job)
            batch = [job for job in batch if job.start()]  # a job cancelled while queued never runs
            if batch:
                self._generate(batch)

    def _generate(self, jobs: list[Job]) -> None:
        self.on_batch(len(jobs))
        rows = RowSampling([j.temperature for j in jobs], [j.top_p for j in jobs],
                           [torch.Generator().manual_seed(j.seed) for j in jobs],
                           top_logprobs=max((j.logprobs or 0) for j in jobs))

        def on_step(step: TokenStep) -> set[int]:
            ended = set()
            for k, (row, token, logprob) in enumerate(zip(step.rows, step.tokens, step.logprobs)):
                job = jobs[row]
                top = step.top[k] if step.top is not None else None
                if job.cancelled.is_set() or job.add(self.tokenizer, token, logprob, top, self.stops):
                    ended.add(row)
            return ended

        try:
            self.engine.generate([j.prompt for j in jobs], max_new_tokens=max(j.max_tokens for j in jobs),
                                 rows=rows, on_step=on_step)
        except Exception as e:  # noqa: BLE001 - every waiting request hears it
            for j in jobs:
                j.done.set_exception(e)
            return
        for j in jobs:
            if j.finish_reason is None:  # cancelled mid-way
                j.finish_reason = "cancelled" if j.cancelled.is_set() else "length"
            j.done.set_result(j)
