"""The command line's argument types: every out-of-range value is one line `error: ...` and exit 2, before
any work starts (a model loads, a server binds). Used by `cli` and by the commands of `agent.commands`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse whose every complaint is one line `error: ...` and exit 2, like any other bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}\n")


def _checked(kind: type, ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse `type`: `kind(text)` when `ok` holds for it; else the option's one-line error."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}")
        return value

    return parse


positive_int = _checked(int, lambda v: v >= 1, "a whole number >= 1")
non_negative_int = _checked(int, lambda v: v >= 0, "a whole number >= 0")
positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
non_negative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
fraction = _checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
port_number = _checked(int, lambda v: 1 <= v <= 65535, "a port number from 1 to 65535")


def k_values(text: str) -> tuple[int, ...]:
    """`--k 1,5`: the distinct k of pass@k, sorted; each a whole number >= 1."""
    try:
        return tuple(sorted({positive_int(k) for k in text.split(",")}))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers >= 1, not {text!r}"
        ) from None
