"""Load user code named in a config as `package.module:function`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tempering.errors import ConfigError


def load_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} '{spec}' is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} '{spec}': cannot import module '{module_name}' ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} '{spec}': module '{module_name}' has no callable '{attr}'")
    return fn
