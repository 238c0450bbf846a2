"""Load user code named in a config as `package.module:function`, and bind functions to their keywords."""

from __future__ import annotations

import functools
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
        raise ConfigError(
            f"{what} '{spec}': cannot import module '{module_name}' ({type(e).__name__}: {e})"
        ) from None
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


ARG = object()
"""Stands in for a tensor / task / trajectory: signature checks bind arguments, they never call."""


def accepted(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The entries of `offered` that `fn` declares as keywords (all of them when it takes `**kwargs`)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature (some builtins): offer everything
        return dict(offered)
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return dict(offered)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in names}


def bind(fn: Callable[..., Any], spec: str, what: str, **hyper: Any) -> Callable[..., Any]:
    """`fn` with its hyper-parameters bound once, called later as `bound(x)`. Every keyword in `hyper` must be
    one `fn` takes and nothing `fn` requires may be left out: a ConfigError otherwise (a misspelt
    hyper-parameter is an error, not silently dropped)."""
    check_call(fn, spec, what, ARG, **hyper)
    return functools.partial(fn, **hyper)
