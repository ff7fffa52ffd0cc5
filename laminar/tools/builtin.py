"""Built-in tools: `python` (a REPL-like code runner, the ReTool workload) and `calculator`.

Both are plain functions of JSON arguments returning the text the model reads. They run inside
a sandbox child process (laminar/tools/sandbox.py), which captures stdout, enforces the
limits and turns exceptions into error observations: an exception's message is what the
model sees (`ZeroDivisionError: division by zero`, the last line of a traceback).
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
from collections.abc import Callable
from typing import Any


def python(code: str) -> str:
    """Run Python code; stdout is captured by the sandbox. If the code ends in an expression, its
    repr is returned (like a REPL), unless it is None."""
    tree = ast.parse(code, filename="<tool>", mode="exec")
    last: ast.Expression | None = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(tree, "<tool>", "exec"), namespace)  # noqa: S102 - the sandbox is the boundary
    if last is None:
        return ""
    value = eval(compile(last, "<tool>", "eval"), namespace)  # noqa: S307
    return "" if value is None else repr(value)


MAX_EXPR_CHARS = 2000
"""Longer calculator expressions are refused."""
MAX_INT_BITS = 14_000
"""No intermediate integer may exceed this many bits (about 4200 decimal digits, under Python's
str(int) limit of 4300)."""

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its result would be too large."""


def _bits(x: int | float) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 64


def _check_size(op: type[ast.operator], a: int | float, b: int | float) -> None:
    """Refuse an operation whose integer result could exceed MAX_INT_BITS before computing it,
    so the calculator can neither hang nor allocate without bound."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return
    if op is ast.Pow:
        if b < 0:
            return  # a float result
        if abs(a) > 1 and math.log2(abs(a)) * b > MAX_INT_BITS:
            raise CalculatorError(f"result of {a}**{b} is too large")
    elif op is ast.Mult and _bits(a) + _bits(b) > MAX_INT_BITS:
        raise CalculatorError("product is too large")


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise CalculatorError("not allowed in an expression: bool")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        _check_size(type(node.op), a, b)
        out: Any = _BINOPS[type(node.op)](a, b)
        if isinstance(out, complex):
            raise CalculatorError("complex result")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        res: int | float = _UNARY[type(node.op)](_eval(node.operand))
        return res
    raise CalculatorError(f"not allowed in an expression: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate arithmetic: integers of any size (within MAX_INT_BITS), floats, + - * / // % **
    and parentheses; no names, no calls."""
    if len(expression) > MAX_EXPR_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an expression: {exc.msg}") from None
    return str(_eval(tree))


BUILTINS: dict[str, tuple[Callable[..., str], bool, str]] = {
    "python": (python, True, "Run Python code; prints and the last expression's value come back."),
    "calculator": (calculator, False, "Evaluate an arithmetic expression (+ - * / // % **)."),
}
"""name -> (function, side_effects, description). `python` may touch files: run at most once."""
