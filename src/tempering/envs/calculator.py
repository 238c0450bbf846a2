"""The calculator tool: arithmetic on number literals through `ast`, never `eval`, with capped exponents,
magnitudes and expression length (the expression is model text)."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from tempering.envs.tool_calls import ToolError

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e15
_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculate(expression: str) -> int | float:
    """Evaluate arithmetic on int/float literals; everything else (names, calls, attributes) is refused.

    Exponents and every intermediate result are capped, so `9**9**9` is refused instead of hanging.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f"cannot parse expression {expression!r}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (limit {MAX_EXPONENT})")
        try:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result is too large") from None
    raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def _checked(value: Any) -> int | float:
    # A negative base to a fractional power is complex in Python: not arithmetic this tool offers.
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"result is out of range (limit {MAX_MAGNITUDE:g})")
    return value


def format_number(value: int | float) -> str:
    """Integral results print as ints (12, not 12.0) so a small model can copy them into its answer."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else repr(round(value, 6))
