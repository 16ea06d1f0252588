"""The built-in ``calculator`` tool: arithmetic on numbers with ``+ - * / ( )`` and unary minus.

It parses the expression with :mod:`ast` and walks the tree itself, accepting only number literals
and those operators: no names, no calls, no attribute access, no ``eval``. Results print as
integers when they are whole (``12*34`` -> ``408``, ``7/2`` -> ``3.5``)."""

from __future__ import annotations

import ast
import operator

from rlinf_lightning.tools.tool import TOOLS, Tool

#: longest expression read (a bound on work: products of huge literals stay cheap, but not free)
MAX_EXPRESSION_CHARS = 200
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> int | float:
    """The value of ``expression``; raises ``ValueError`` for anything but numbers, ``+ - * /``,
    parentheses and unary minus (and ``ZeroDivisionError`` for a division by zero)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (whole numbers without a decimal point)."""
    value = evaluate(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR = TOOLS.register(
    "calculator",
    Tool("calculator", calculate, tag="calc"),
    description="arithmetic: numbers, + - * / ( ), unary minus (called as <calc>12*34</calc>)",
)
