"""A mirror of a run's checkpoints on any fsspec filesystem: `s3://bucket/prefix` (s3fs), `memory://name`,
or another local path.

Layout at the URI is the local one: `step_NNNNNN/...`, its `MANIFEST.json` uploaded after every other
file, then `LATEST`. A remote checkpoint counts only when its manifest is there and the downloaded files
match it; a partial upload (killed mid-way) has no manifest and is skipped.

Every operation is retried with exponential backoff; what still fails raises `CheckpointError`, which
the saver reports without stopping the run (the local copy stays).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tempering.checkpoint.local import (
    LATEST,
    MANIFEST,
    checkpoint_name,
    parse_manifest,
    parse_step,
    retained,
    verify,
)
from tempering.errors import CheckpointError

T = TypeVar("T")


def storage_options_from(config: dict[str, Any] | None) -> dict[str, Any]:
    """fsspec options from `checkpoint.storage` ({endpoint_url, region, key, secret, ...}); unset ones come
    from the usual environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL...)."""
    opts = dict(config or {})
    out: dict[str, Any] = {}
    if "endpoint_url" in opts:
        out["endpoint_url"] = opts.pop("endpoint_url")
    if "region" in opts:
        out.setdefault("client_kwargs", {})["region_name"] = opts.pop("region")
    out.update(opts)
    return out


class RemoteStore:
    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 1.0,
        log: Callable[[str], None] = print,
    ):
        import fsspec

        try:
            self.fs, self.root = fsspec.core.url_to_fs(uri, **storage_options_from(storage_options))
        except (ImportError, ValueError) as e:
            raise CheckpointError(f"checkpoint.uri '{uri}': {e}") from None
        self.uri, self.retries, self.backoff_s, self.log = uri, retries, backoff_s, log
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:  # storage clients raise many kinds; all are retried the same way
                if attempt == self.retries:
                    raise CheckpointError(
                        f"{what} at {self.uri} failed after {attempt + 1} attempts: {type(e).__name__}: {e}"
                    ) from None
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------- write

    def upload(self, local_dir: Path) -> None:
        """Copy a verified local checkpoint: data files, then MANIFEST, then LATEST."""
        name = local_dir.name
        files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
        for path in files:
            rel = path.relative_to(local_dir).as_posix()
            self.retry(
                f"uploading {name}/{rel}", lambda p=path, r=rel: self.fs.put_file(str(p), self._path(name, r))
            )
        self.retry(
            f"uploading {name}/{MANIFEST}",
            lambda: self.fs.put_file(str(local_dir / MANIFEST), self._path(name, MANIFEST)),
        )
        self.retry(f"writing {LATEST}", lambda: self.fs.pipe_file(self._path(LATEST), (name + "\n").encode()))
        self.fs.invalidate_cache()

    def prune(self, keep: int, keep_every: int | None, protect: int | None) -> None:
        """Retention over the complete checkpoints; an incomplete one (an upload cut short, no manifest)
        older than `protect` is deleted too."""
        steps = self.steps()
        complete = [s for s in steps if self.has_manifest(s)]
        for step in steps:
            partial = step not in complete and protect is not None and step < protect
            if (
                partial or (step in complete and not retained(step, complete, keep, keep_every))
            ) and step != protect:
                self.retry(
                    f"deleting {checkpoint_name(step)}",
                    lambda s=step: self.fs.rm(self._path(checkpoint_name(s)), recursive=True),
                )
        self.fs.invalidate_cache()

    # -------------------------------------------------------------------------------------- read

    def steps(self) -> list[int]:
        """Steps with a directory at the URI (complete or not), newest first."""

        def listing() -> list[str]:
            self.fs.invalidate_cache()
            return self.fs.ls(self.root, detail=False) if self.fs.exists(self.root) else []

        found = [parse_step(Path(p).name) for p in self.retry("listing checkpoints", listing)]
        return sorted((s for s in found if s is not None), reverse=True)

    def has_manifest(self, step: int) -> bool:
        return self.retry(
            "reading a manifest", lambda: self.fs.exists(self._path(checkpoint_name(step), MANIFEST))
        )

    def download(self, step: int, local_root: Path) -> tuple[Path | None, str | None]:
        """Fetch checkpoint `step` into `local_root`, verify it; (its local path, None) or (None, why not)."""
        name = checkpoint_name(step)
        if not self.has_manifest(step):
            return None, "no MANIFEST.json (the upload did not finish)"
        data = self.retry("reading a manifest", lambda: self.fs.cat_file(self._path(name, MANIFEST)))
        files, problem = parse_manifest(data)
        if problem:
            return None, problem
        tmp = local_root / f"{name}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                self.retry(
                    f"downloading {name}/{rel}",
                    lambda r=rel: self.fs.get_file(self._path(name, r), str(tmp / r)),
                )
            except CheckpointError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                return None, str(e)
        (tmp / MANIFEST).write_bytes(data)
        problem = verify(tmp)
        if problem:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, problem
        final = local_root / name
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final, None
