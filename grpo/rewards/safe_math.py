"""A bounded evaluator for arithmetic written by a model: never `eval`, never unbounded work.

The countdown reward of the seed tutorials (and TinyZero) runs `eval(equation, {"__builtins__": None}, {})` behind
a character regex. That is open to denial of service: `9**9**9**9` passes the regex and ran for more than 60 s, and
`99999**3999999` beat `simpleeval`'s exponent cap (reliability.md section 2.3-2.4, measured). This module follows the
shape recommended there: an ASCII whitelist, `ast.parse(mode="eval")`, a node and depth budget, only numbers,
`+ - * / **` and unary `+ -`, exact `Fraction` arithmetic, and a size check *before* every multiplication or power.
Every adversarial input of the research corpus is rejected in well under a millisecond.
"""

import ast
import math
import re
from dataclasses import dataclass
from fractions import Fraction


class NotArithmetic(ValueError):
    """The text is not an arithmetic expression (letters, calls, syntax errors, unknown operators)."""


class ArithmeticRejected(ValueError):
    """The text is arithmetic, but evaluating it is refused: too large, division by zero, non-rational power."""


@dataclass(frozen=True)
class Limits:
    """Budgets for one evaluation. The defaults admit any countdown or school-arithmetic expression."""

    max_chars: int = 256  # longer inputs are refused before parsing (a 100 000-long unary chain is a MemoryError)
    max_nodes: int = 64  # AST nodes
    max_depth: int = 32  # nesting of operations and parentheses
    max_bits: int = 4096  # numerator/denominator size of any literal, operand or result
    max_exponent: int = 64  # |e| in a ** e
    allow_power: bool = True


DEFAULT_LIMITS = Limits()

# ASCII only: `\d` and `int()` accept Arabic-Indic or full-width digits that `ast` then rejects (reliability.md 2.3).
_ALLOWED = re.compile(r"[0-9+\-*/(). \t]*")
_BINARY_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)


def safe_eval(text: str, limits: Limits = DEFAULT_LIMITS) -> Fraction:
    """Evaluate an arithmetic expression exactly, or raise `NotArithmetic` / `ArithmeticRejected`.

    >>> safe_eval("(95 - 21) * 3 - 54")
    Fraction(168, 1)
    """
    return evaluate(parse_arithmetic(text, limits), limits)


def parse_arithmetic(text: str, limits: Limits = DEFAULT_LIMITS) -> ast.Expression:
    """Check characters, size and node types; return the parsed tree without evaluating it."""
    if not isinstance(text, str):
        raise NotArithmetic(f"expected a string, got {type(text).__name__}")
    if len(text) > limits.max_chars:
        raise ArithmeticRejected(f"expression longer than {limits.max_chars} characters")
    if not _ALLOWED.fullmatch(text):
        raise NotArithmetic("only ASCII digits, spaces, '.', parentheses and + - * / are allowed")
    if _paren_depth(text) > limits.max_depth:
        raise ArithmeticRejected(f"parentheses nested deeper than {limits.max_depth}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        raise NotArithmetic(f"not a valid expression: {type(error).__name__}") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > limits.max_nodes:
        raise ArithmeticRejected(f"more than {limits.max_nodes} syntax nodes")
    for node in nodes:
        _check_node(node, limits)
    return tree


def evaluate(tree: ast.Expression, limits: Limits = DEFAULT_LIMITS) -> Fraction:
    """Evaluate a tree returned by `parse_arithmetic` (with the same limits), or raise `ArithmeticRejected`."""
    return _evaluate(tree.body, limits)


def literals(tree: ast.Expression) -> list[Fraction]:
    """The number literals of a checked tree, in source order (the numbers a countdown answer uses)."""
    constants = [node for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    constants.sort(key=lambda node: (node.lineno, node.col_offset))
    return [_literal_value(node) for node in constants]


def _literal_value(node: ast.Constant) -> Fraction:
    # Via repr so that `0.1` means 1/10, as written, not the nearest binary float.
    return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)


def _paren_depth(text: str) -> int:
    depth = deepest = 0
    for char in text:
        depth += (char == "(") - (char == ")")
        deepest = max(deepest, depth)
    return deepest


def _check_node(node: ast.AST, limits: Limits) -> None:
    if isinstance(node, ast.Constant):
        # bool is an int subclass, but `True` cannot appear in ASCII-digit text; the check is for clarity.
        if type(node.value) not in (int, float):
            raise NotArithmetic(f"literal {node.value!r} is not a number")
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ArithmeticRejected("literal is not finite")
    elif isinstance(node, ast.BinOp):
        if not isinstance(node.op, _BINARY_OPS) or (isinstance(node.op, ast.Pow) and not limits.allow_power):
            raise NotArithmetic(f"operator {type(node.op).__name__} is not allowed")
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.UAdd, ast.USub)):
            raise NotArithmetic(f"operator {type(node.op).__name__} is not allowed")
    elif not isinstance(node, (ast.Expression, ast.operator, ast.unaryop)):
        raise NotArithmetic(f"{type(node).__name__} is not arithmetic")


def _evaluate(node: ast.AST, limits: Limits, depth: int = 0) -> Fraction:
    if depth > limits.max_depth:
        raise ArithmeticRejected(f"operations nested deeper than {limits.max_depth}")
    if isinstance(node, ast.Constant):
        return _bounded(_literal_value(node), limits)
    if isinstance(node, ast.UnaryOp):
        value = _evaluate(node.operand, limits, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    left = _evaluate(node.left, limits, depth + 1)
    right = _evaluate(node.right, limits, depth + 1)
    return _bounded(_apply(node.op, left, right, limits), limits)


def _apply(op: ast.operator, left: Fraction, right: Fraction, limits: Limits) -> Fraction:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        if _bits(left) + _bits(right) > limits.max_bits:
            raise ArithmeticRejected("product too large")
        return left * right
    if isinstance(op, ast.Div):
        if right == 0:
            raise ArithmeticRejected("division by zero")
        if _bits(left) + _bits(right) > limits.max_bits:
            raise ArithmeticRejected("quotient too large")
        return left / right
    return _power(left, right, limits)


def _power(base: Fraction, exponent: Fraction, limits: Limits) -> Fraction:
    # Checked before computing: CPython's big-int pow is where `9**9**9**9` spends its minutes.
    if exponent.denominator != 1:
        raise ArithmeticRejected("fractional exponent (result may be irrational or complex)")
    power = exponent.numerator
    if abs(power) > limits.max_exponent:
        raise ArithmeticRejected(f"exponent larger than {limits.max_exponent}")
    if base == 0 and power < 0:
        raise ArithmeticRejected("division by zero")
    if _bits(base) * abs(power) > limits.max_bits:
        raise ArithmeticRejected("power too large")
    return base**power


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _bounded(value: Fraction, limits: Limits) -> Fraction:
    if _bits(value) > limits.max_bits:
        raise ArithmeticRejected(f"number larger than {limits.max_bits} bits")
    return value
