"""Errors a user can act on. The CLI prints their message on one line and exits non-zero."""


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


class Preempted(Exception):
    """The run was asked to stop (SIGTERM) and has saved its state; not an error (exit status 0)."""
