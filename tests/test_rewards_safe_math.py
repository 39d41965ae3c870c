"""The bounded arithmetic evaluator: exact values, and refusal of every hostile input within a millisecond budget."""

import time
from fractions import Fraction

import pytest

from grpo.rewards.safe_math import ArithmeticRejected, Limits, NotArithmetic, literals, parse_arithmetic, safe_eval


@pytest.mark.parametrize(
    "text, value",
    [
        ("(95 - 21) * 3 - 54", Fraction(168)),  # 74 * 3 = 222; 222 - 54 = 168
        ("1/3 + 1/6", Fraction(1, 2)),  # exact: 2/6 + 1/6 = 3/6
        ("8 * 2 - 1", Fraction(15)),
        ("-(4 - 6)", Fraction(2)),
        ("0.1 + 0.2", Fraction(3, 10)),  # decimals as written, not as binary floats
        ("2 ** 10", Fraction(1024)),
        ("2 ** -2", Fraction(1, 4)),
        ("(((7)))", Fraction(7)),
    ],
)
def test_exact_values(text, value):
    assert safe_eval(text) == value


# Each row: an input and the exception it must raise. The first group is not arithmetic at all; the second is
# arithmetic whose evaluation is refused (reliability.md 2.3-2.4 corpus).
HOSTILE = [
    ("__import__('os').system('x')", NotArithmetic),
    ("(1).real", NotArithmetic),
    ("().__class__.__bases__[0].__subclasses__()", NotArithmetic),
    ("lambda: 1", NotArithmetic),
    ("abs(-1)", NotArithmetic),
    ("x + 1", NotArithmetic),
    ("'1' + '2'", NotArithmetic),
    ("٤٢ + 1", NotArithmetic),  # Arabic-Indic digits: `\d` and int() accept them, ast does not
    ("４２ + 1", NotArithmetic),  # full-width digits
    ("1_000", NotArithmetic),
    ("7 // 2", NotArithmetic),
    ("7 % 2", NotArithmetic),
    ("()", NotArithmetic),
    ("...", NotArithmetic),
    ("1 +", NotArithmetic),
    ("1e309", NotArithmetic),  # 'e' is not an allowed character
    ("9**9**9**9", ArithmeticRejected),
    ("99999**3999999", ArithmeticRejected),
    ("95**21**3**54", ArithmeticRejected),
    ("2**4000 * 2**4000", ArithmeticRejected),
    ("(-8)**(1/3)", ArithmeticRejected),
    ("1/(3-3)", ArithmeticRejected),
    ("0 ** -1", ArithmeticRejected),
    ("(" * 1000 + "1" + ")" * 1000, ArithmeticRejected),
    ("(" * 40 + "1" + ")" * 40, ArithmeticRejected),  # deeper than 32, short enough to reach the depth check
    ("-" * 100_000 + "1", ArithmeticRejected),
    ("+".join(["1"] * 100), ArithmeticRejected),  # 199 nodes > 64
]


@pytest.mark.parametrize("text, error", HOSTILE)
def test_hostile_inputs_are_refused_fast(text, error):
    start = time.perf_counter()
    with pytest.raises(error):
        safe_eval(text)
    assert time.perf_counter() - start < 0.05


def test_power_can_be_switched_off():
    with pytest.raises(NotArithmetic):
        safe_eval("2 ** 3", Limits(allow_power=False))


def test_literals_are_in_source_order():
    assert literals(parse_arithmetic("8 * 2 - 1")) == [8, 2, 1]
