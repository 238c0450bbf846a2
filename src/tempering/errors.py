"""Errors a user can act on. The CLI prints their message on one line and exits non-zero."""

import errno
import os


class TemperingError(Exception):
    """Base class: bad input or an unusable environment, described in words a user can act on."""


class ConfigError(TemperingError):
    """An unknown key, a wrong type or an invalid value in a config file or override."""


class TaskFileError(TemperingError):
    """A malformed task file; the message names the file and line."""


class ModelLoadError(TemperingError):
    """A model path that is missing or is not a loadable Hugging Face causal-LM directory."""


class SandboxError(TemperingError):
    """The sandbox cannot run (a worker failed to start, a remote server is down)."""


class CheckpointError(TemperingError):
    """A checkpoint that cannot be read or written."""


class DiskFullError(TemperingError):
    """A write the run cannot go on without failed because the disk (or quota) is full; the message names
    the path."""


DISK_FULL_MARKS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
"""How writers that do not raise an OSError (safetensors, tokenizers: Rust) say ENOSPC / EDQUOT."""


def disk_full(error: BaseException, where: str | os.PathLike) -> bool:
    """Whether `error`, raised writing under `where`, means the disk is full: ENOSPC or EDQUOT anywhere in
    its chain, or - torch's own file writer says only "unexpected pos" - under 1 MiB left at `where`."""
    chain, seen = [], error
    while seen is not None and len(chain) < 32:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in chain:
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
            mark in str(e) for mark in DISK_FULL_MARKS
        ):
            return True
    return free_bytes(where) < 1 << 20


def free_bytes(where: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `where` (or its nearest existing
    parent); a huge number when that cannot be told."""
    path = os.path.abspath(where)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


class Preempted(Exception):
    """The run was asked to stop (SIGTERM) and has saved its state; not an error (exit status 0)."""
