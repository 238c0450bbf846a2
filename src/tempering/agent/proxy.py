"""The trainer's recording proxy: `tempering serve --sessions` in the trainer's process, for its agents.

A rollout of agent episodes (`agent.episodes`, with `agent.entry` or `agent.command` set) serves the
rollout engine through the server `tempering serve --sessions` runs (`server.OpenAIServer`), on a Unix
socket in a private directory: the agents reach it through the relay of their confinement (`runner.py`),
with the key of a session the trainer opened for them. Only session keys get in (the server's own token is
never handed out), so an agent can call the completions and its own session's `/reward` and `/close`, and
open no session of its own.

The engine behind it is `Lockstep`: a call waits until every agent still running has a call waiting (or has
finished), then all waiting calls run as one batch, in a fixed order. Which calls share a decode batch -
and so the numbers they compute, to the last bit - depends on what the agents do, never on when their calls
arrive: a rerun of the same step (a resumed run) samples the same tokens with the same log-probs, as the
built-in episodes do. (An agent that makes several calls at once, or works while another waits, only
delays the batch, by at most `agent.patience_s`: a call that waited that long runs with the calls waiting
beside it, and that batch - like a run cut by its time limit - depends on the clock.)
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time

from tempering.agent.backends import LocalModel
from tempering.agent.openai_api import ServeLimits
from tempering.agent.sessions import Sampling, Session, SessionLimits, SessionRecord, SessionStore
from tempering.inference.protocol import Handle, Request


class Lockstep:
    """A request engine over a `LocalEngine` whose batches are its agents' calls, all at once (see above).
    `expect(n)` says how many agents run now; `done_one()` that one of them has finished. A call waits at
    most `patience_s`: past it the calls waiting run without the agents still working."""

    def __init__(self, engine, patience_s: float = 10.0):
        self.engine, self.tokenizer, self.stop_ids = engine, engine.tokenizer, engine.stop_ids
        self.patience_s = patience_s
        self.cond = threading.Condition()
        self.waiting: list[tuple[float, Handle]] = []
        self.running = 0
        self.busy = False
        self.closed = False
        self.thread: threading.Thread | None = None

    def expect(self, n: int) -> None:
        with self.cond:
            self.running += n
            self.cond.notify()

    def done_one(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify()

    def submit(self, request: Request) -> Handle:
        handle = Handle(request)
        with self.cond:
            self.waiting.append((time.monotonic(), handle))
            self.cond.notify()
        return handle

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="lockstep", daemon=True)
        self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _wait(self) -> float | None:
        """Seconds until the waiting calls run (0: now), None: no call waits."""
        if not self.waiting:
            return None
        if len({h.request.client for _, h in self.waiting}) >= self.running:
            return 0.0
        return max(0.0, self.waiting[0][0] + self.patience_s - time.monotonic())

    def drain(self) -> None:
        """Cancel what waits, and return once no batch runs: the engine is the trainer's again."""
        with self.cond:
            for _, h in self.waiting:
                h.cancel()
            self.running = 0
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.waiting and not self.busy, timeout=60)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (wait := self._wait()) != 0.0:
                    self.cond.wait(wait)
                if self.closed:
                    return
                batch, self.waiting, self.busy = [h for _, h in self.waiting], [], True
            batch.sort(key=lambda h: (h.request.seed, h.request.client, h.request.prompt))
            try:
                self.engine.scheduler.add(batch)
                self.engine.run(batch)
            except Exception as e:  # noqa: BLE001 - every call of the batch hears it
                for h in batch:
                    if not h.done():
                        h.future.set_exception(e)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()


class Proxy:
    """The server on its socket, in a thread; `open(sampling)` a session for one agent run, `finish` it."""

    def __init__(
        self, engine, fmt, max_context: int, limits: SessionLimits, concurrency: int, patience_s: float = 10.0
    ):
        import uvicorn

        from tempering.agent.server import OpenAIServer

        self.lockstep = Lockstep(engine, patience_s)
        self.dir = tempfile.mkdtemp(prefix="tempering-proxy-")
        os.chmod(self.dir, 0o700)
        self.socket = os.path.join(self.dir, "proxy.sock")
        chat = LocalModel("policy", self.lockstep, engine.tokenizer, fmt, max_context)
        serve = ServeLimits(max_pending=max(256, 8 * concurrency), client_pending=8)
        self.server = OpenAIServer(chat, token=secrets.token_urlsafe(32), limits=serve, sessions=limits)
        self.store: SessionStore = self.server.sessions
        config = uvicorn.Config(self.server.app(), uds=self.socket, log_level="warning", lifespan="on")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, name="proxy", daemon=True)
        self.thread.start()
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            self.thread.join(0.01)

    def open(self, sampling: Sampling) -> Session:
        return self.store.create(sampling)

    def finish(self, session: Session) -> list[SessionRecord]:
        """The session's records, whether its agent closed it or the trainer does now."""
        return self.store.collect(session)

    def close(self) -> None:
        """Stop the server (idempotent: a runtime closes at its engine's end or at exit, whichever is first)."""
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)
        self.lockstep.close()
        shutil.rmtree(self.dir, ignore_errors=True)
