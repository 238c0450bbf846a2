"""Saving while training goes on, and resuming from the newest valid checkpoint, local or remote.

`Saver.save(snapshot)` returns as soon as the previous save has been written locally (at most one save is
in flight, so at most one extra copy of the state is held in memory); a writer thread writes the
snapshot to the local checkpoint directory, and - when `checkpoint.uri` is set - an uploader thread
mirrors the newest local checkpoint to the URI, retrying with backoff. An upload that keeps failing is
reported and retried with the next checkpoint; it never stops training, and the local copy stays.
`close()` waits for both (the process waits for its last save at exit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from rich.markup import escape

from tempering.checkpoint.local import LATEST, Checkpoint, Snapshot, find_latest, verify, write_snapshot
from tempering.checkpoint.remote import RemoteStore
from tempering.errors import CheckpointError, DiskFullError


class Saver:
    def __init__(
        self,
        root: Path,
        *,
        keep: int = 2,
        keep_every: int | None = None,
        remote: RemoteStore | None = None,
        asynchronous: bool = True,
        log: Callable[[str], None] = print,
    ):
        self.root, self.keep, self.keep_every, self.remote = root, keep, keep_every, remote
        self.asynchronous, self.log = asynchronous, log
        self.errors: list[str] = []
        self.last_failure: Exception | None = None
        """What the newest failed save raised (a `DiskFullError` when the disk was full)."""
        self._pending: Snapshot | None = None
        self._idle = threading.Condition()
        self._writing = False
        self._closed = False
        self._upload_wanted = threading.Event()
        self._uploaded: set[str] = set()
        self._uploading: str | None = None  # pinned: local retention must not delete it mid-upload
        self._writer = threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True)
        self._uploader = threading.Thread(target=self._upload_loop, name="checkpoint-uploader", daemon=True)
        if asynchronous:
            self._writer.start()
        if remote is not None:
            self._uploader.start()

    # ----------------------------------------------------------------------------------- saving

    def save(self, snap: Snapshot) -> None:
        if not self.asynchronous:
            self._write(snap)
            return
        with self._idle:
            while self._writing or self._pending is not None:  # at most one save in flight
                self._idle.wait()
            self._pending = snap
            self._writing = True
            self._idle.notify_all()

    def wait(self) -> None:
        """Until the last submitted snapshot is written locally."""
        with self._idle:
            while self._writing or self._pending is not None:
                self._idle.wait()

    def _write_loop(self) -> None:
        while True:
            with self._idle:
                while self._pending is None and not self._closed:
                    self._idle.wait()
                if self._pending is None:
                    return
                snap = self._pending
            try:
                self._write(snap)
            finally:
                with self._idle:
                    self._pending = None
                    self._writing = False
                    self._idle.notify_all()

    def _write(self, snap: Snapshot) -> Checkpoint | None:
        try:
            pinned = frozenset([self._uploading] if self._uploading else [])
            ckpt = write_snapshot(self.root, snap, keep=self.keep, keep_every=self.keep_every, protect=pinned)
        except Exception as e:  # a full disk must not kill the run: report, keep training
            self.last_failure = e
            self.errors.append(
                f"checkpoint step {snap.step} not saved: {e}"
                if isinstance(e, DiskFullError)
                else f"saving step {snap.step} failed: {type(e).__name__}: {e}"
            )
            self.log(f"[yellow]{escape(self.errors[-1])}; {self.kept()}[/]")  # torch's text has [brackets]
            return None
        self._upload_wanted.set()
        return ckpt

    def kept(self) -> str:
        """What a resume would start from now, in words (torch's own writer, on a full disk, says only
        "unexpected pos": the messages say what is kept)."""
        latest = self.root / LATEST
        return (
            f"{LATEST} still names {latest.read_text().strip()}"
            if latest.is_file()
            else "no checkpoint is saved yet"
        )

    # ---------------------------------------------------------------------------------- uploading

    def _upload_loop(self) -> None:
        while True:
            self._upload_wanted.wait()
            self._upload_wanted.clear()
            self._upload_newest()
            if self._closed and not self._upload_wanted.is_set():
                return

    def _upload_newest(self) -> None:
        latest, _ = find_latest(self.root)
        if latest is None or latest.path.name in self._uploaded:
            return
        self._uploading = latest.path.name
        try:
            self.remote.upload(latest.path)
            self._uploaded.add(latest.path.name)
            self.remote.prune(self.keep, self.keep_every, protect=latest.step)
        except CheckpointError as e:
            self.errors.append(
                f"{e}; the checkpoint is kept locally and the upload retried with the next save"
            )
            self.log(f"[yellow]{escape(self.errors[-1])}[/]")
        finally:
            self._uploading = None

    # ---------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Wait for the last save and its upload."""
        if self.asynchronous:
            self.wait()
            with self._idle:
                self._closed = True
                self._idle.notify_all()
            self._writer.join()
        self._closed = True
        if self.remote is not None:
            self._upload_wanted.set()
            self._uploader.join()
            latest, _ = find_latest(self.root)
            if latest is not None and latest.path.name not in self._uploaded:
                self._upload_newest()  # one more try: the run is ending


def resume_point(
    root: Path, remote: RemoteStore | None, log: Callable[[str], None] = print
) -> Checkpoint | None:
    """The newest valid checkpoint, local or remote (downloaded into `root` when the remote one is newer).
    Partial or corrupt checkpoints are named in the log and skipped."""
    local, skipped = find_latest(root)
    for note in skipped:
        log(f"[yellow]{escape(note)}[/]")
    if remote is None:
        return local
    try:
        steps = remote.steps()
    except CheckpointError as e:
        log(f"[yellow]cannot list remote checkpoints ({escape(str(e))}); resuming from local ones[/]")
        return local
    for step in steps:
        if local is not None and step <= local.step:
            break
        path, problem = remote.download(step, root)
        if path is None:
            log(f"[yellow]remote checkpoint step_{step:06d} skipped: {problem}[/]")
            continue
        assert verify(path) is None
        log(f"downloaded step_{step:06d} from {remote.uri}")
        return Checkpoint(path, step)
    return local
