"""Load user code named in a config as `package.module:function`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from tempering.errors import ConfigError


def load_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} '{spec}' is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - user code may fail to import in any way; say which and why
        raise ConfigError(f"{what} '{spec}': cannot import module '{module_name}' "
                          f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} '{spec}': module '{module_name}' has no callable '{attr}'")
    return fn


def check_call(fn: Callable[..., Any], spec: str, what: str, *args: Any, **kwargs: Any) -> None:
    """Raise ConfigError when `fn(*args, **kwargs)` - the call the run will make - cannot bind: a
    parameter it lacks or one it requires that the run does not pass. Checked at load time, so the
    mistake costs seconds, not a warm-up stage."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no introspectable signature: nothing to check
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{what} '{spec}' cannot take the arguments the run passes ({e})") from None
