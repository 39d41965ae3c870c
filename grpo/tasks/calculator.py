"""The `calculator` task: integer arithmetic too large for a tiny model's head, with a `calculator` tool to call.

    prompt:     "What is 482 * 37?"            (a user message; the chat template lists the tools)
    completion: <tool_call>
                {"name": "calculator", "arguments": {"expression": "482 * 37"}}
                </tool_call>                   (the model's turn, then the tool's answer "17834", then:)
                <answer>17834</answer>

One operation, + - or *, on two operands whose digit counts are drawn uniformly from 1..max_digits. Only
problems with two one-digit operands are easy enough to answer without the tool. The reward is `math_accuracy` on
the model's own text (the tool's answer is not the model's: it must copy it into <answer>).

| difficulty | max_digits | problems |
|---|---|---|
| 1 | 2 | ~3 * 10^4 |
| 2 (default) | 3 | ~3 * 10^6 |
| 3 | 4 | ~3 * 10^8 |
"""

from __future__ import annotations

import random

from grpo.tasks._common import sample_rows

OPERATORS = ("+", "-", "*")
DIGITS = {1: 2, 2: 3, 3: 4}
DEFAULT_DIFFICULTY = 2


def value_of(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def rows(split: str, n: int, seed: int = 0, difficulty: int = DEFAULT_DIFFICULTY,
         max_digits: int | None = None) -> list[dict]:
    """`n` rows of `split`: prompt, answer (the integer as text) and expression; held out by expression text."""
    if difficulty not in DIGITS:
        raise ValueError(f"calculator: unknown difficulty {difficulty!r}; use one of {sorted(DIGITS)}")
    digits = max_digits or DIGITS[difficulty]
    if digits < 1:
        raise ValueError(f"calculator: max_digits must be >= 1, got {digits}")

    def draw(rng: random.Random) -> tuple[str, dict]:
        a, op, b = operand(rng, digits), rng.choice(OPERATORS), operand(rng, digits)
        expression = f"{a} {op} {b}"
        return expression, {"prompt": f"What is {expression}?", "answer": str(value_of(a, op, b)),
                            "expression": expression}

    return sample_rows("calculator", split, n, seed, draw)
