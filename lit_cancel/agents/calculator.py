"""A calculator tool for word problems: arithmetic read with ``ast``, never ``eval``, and its environment.

:func:`calculate` takes numbers (``1,000`` too, as GSM8K writes them, and ``007``), ``+ - * / // % **``, signs and parentheses, and
refuses anything else (names, calls, attributes, text) with a ValueError whose message the policy reads as the tool's
answer. Exponents above :data:`MAX_EXPONENT` and integers beyond :data:`MAX_BITS` bits are refused too, so that no call
can spend the episode's time or memory on one number.
"""

import ast
import math
import operator
import re
from collections.abc import Callable

from lit_cancel.agents.tools import CallFormat, ToolEnvironment

MAX_CHARS = 500  # the evaluator recurses once per operator: a longer chain could exhaust the stack
MAX_EXPONENT = 100
MAX_BITS = 1000
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")

BINARY: dict[type, Callable] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
UNARY: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(48 / 2) * 3 - 5".
    """
    text = LEADING_ZEROS.sub("", THOUSANDS.sub("", str(expression))).strip()
    if len(text) > MAX_CHARS:
        raise ValueError(f"the expression has {len(text)} characters; at most {MAX_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot read {text!r} as arithmetic: {error.msg}") from None
    return formatted(evaluated(tree.body))


def evaluated(node: ast.AST) -> int | float:
    """The value of one node of an expression's tree; ValueError naming what is not arithmetic."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluated(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluated(node.left), evaluated(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {formatted(right)} is too large; at most {MAX_EXPONENT}")
        try:
            return checked(BINARY[type(node.op)](left, right))
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def checked(value: int | float) -> int | float:
    """``value``, or ValueError where it is not a real number or too large to be a useful answer."""
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ValueError("the result is not a real number")
    if (isinstance(value, int) and value.bit_length() > MAX_BITS) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("the result is too large")
    return value


def formatted(value: int | float) -> str:
    """A value as the policy reads it: integers exactly, floats to 12 significant digits (``24.0`` as ``24``)."""
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class CalculatorEnvironment(ToolEnvironment):
    """An episode with the :func:`calculate` tool: the policy calls it until a turn calls no tool, its answer.

    Args:
        calls, timeout, max_output_chars, max_calls_per_turn: as :class:`~lit_cancel.agents.ToolEnvironment`.

    Example (YAML, in an :class:`~lit_cancel.agents.EnvironmentTask`)::

        environment: lit_cancel.agents.CalculatorEnvironment
    """

    def __init__(self, calls: CallFormat | None = None, timeout: float = 10.0, max_output_chars: int = 2000,
                 max_calls_per_turn: int = 8):
        super().__init__([calculate], calls, timeout, max_output_chars, max_calls_per_turn)
