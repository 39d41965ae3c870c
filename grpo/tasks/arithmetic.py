"""The `arithmetic` task: "Calculate 2 + 2 * 6" (the running example of the GRPO tutorial seed), integer answers.

Expressions use + - * with the usual precedence and, from difficulty 3 on, one parenthesised group. A worked
solution evaluates one operation per line, `a op b = c`, in the order a person would: parenthesised groups first
(innermost first), then every `*` from left to right, then `+` and `-` from left to right. For example:

    prompt:     "Calculate 2 + 2 * 6\\n"
    completion: "2 * 6 = 12\\n2 + 12 = 14\\n</think>\\n<answer>14</answer>"   (after the prefill "<think>")

Difficulty levels (operands are drawn uniformly from 1..max_operand, operators uniformly from + - *):

| level | operands | operand range | parentheses | problems |
|---|---|---|---|---|
| 1 | 2 | 1..9 | never | 243 |
| 2 (default) | 2-3 | 1..9 | never | 6,804 |
| 3 | 2-4 | 1..20 | one group, 30 % of problems with 3+ operands | ~10^7 |
| 4 | 3-5 | 1..50 | one group, 50 % of problems | ~10^11 |

Any field of a level can be overridden by a knob of the same name (`min_operands`, `max_operands`, `max_operand`,
`paren_prob`).
"""

from __future__ import annotations

import dataclasses
import operator
import random
import re
from typing import Callable, Union

from grpo.tasks._common import ANSWER_TEMPLATE, sample_rows

# An expression as nested lists, operands and operators alternating: 2 + (3 * 4) is [2, "+", [3, "*", 4]].
Items = list[Union[int, str, "Items"]]

OPERATORS = ("+", "-", "*")
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# Precedence classes, reduced in this order, each from left to right.
_PRECEDENCE = (("*",), ("+", "-"))
_TOKEN = re.compile(r"\s*(\d+|[-+*()])")


@dataclasses.dataclass(frozen=True)
class Difficulty:
    """How `arithmetic` problems are drawn."""

    min_operands: int
    max_operands: int
    max_operand: int  # operands are drawn uniformly from 1..max_operand
    paren_prob: float  # probability that a problem with 3+ operands gets one parenthesised group


DIFFICULTIES = {
    1: Difficulty(min_operands=2, max_operands=2, max_operand=9, paren_prob=0.0),
    2: Difficulty(min_operands=2, max_operands=3, max_operand=9, paren_prob=0.0),
    3: Difficulty(min_operands=2, max_operands=4, max_operand=20, paren_prob=0.3),
    4: Difficulty(min_operands=3, max_operands=5, max_operand=50, paren_prob=0.5),
}
DEFAULT_DIFFICULTY = 2


def resolve_difficulty(difficulty: int = DEFAULT_DIFFICULTY, **overrides) -> Difficulty:
    """The level `difficulty` with any of its fields replaced by `overrides` (None means "keep the level's")."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"arithmetic: unknown difficulty {difficulty!r}; use one of {sorted(DIFFICULTIES)}")
    d = dataclasses.replace(DIFFICULTIES[difficulty], **{k: v for k, v in overrides.items() if v is not None})
    if not 2 <= d.min_operands <= d.max_operands:
        raise ValueError(f"arithmetic: need 2 <= min_operands <= max_operands, got {d.min_operands}, {d.max_operands}")
    if d.max_operand < 1:
        raise ValueError(f"arithmetic: max_operand must be >= 1, got {d.max_operand}")
    if not 0.0 <= d.paren_prob <= 1.0:
        raise ValueError(f"arithmetic: paren_prob must be in [0, 1], got {d.paren_prob}")
    return d


def sample_items(rng: random.Random, d: Difficulty) -> Items:
    """One random expression drawn as described by `d`."""
    count = rng.randint(d.min_operands, d.max_operands)
    items: Items = [rng.randint(1, d.max_operand)]
    for _ in range(count - 1):
        items += [rng.choice(OPERATORS), rng.randint(1, d.max_operand)]
    if count >= 3 and rng.random() < d.paren_prob:
        size = rng.randint(2, count - 1)  # a proper sub-expression: never the whole expression
        start = rng.randint(0, count - size)
        lo, hi = 2 * start, 2 * (start + size) - 1  # item indices of its first operand and one past its last
        items = items[:lo] + [items[lo:hi]] + items[hi:]
    return items


def format_items(items: Items) -> str:
    """The expression text, e.g. "2 + (3 * 4)"."""
    return " ".join(f"({format_items(x)})" if isinstance(x, list) else str(x) for x in items)


def parse_expression(text: str) -> Items:
    """Inverse of `format_items` for expressions of non-negative integers, + - * and parentheses."""
    tokens, pos = [], 0
    while pos < len(text.rstrip()):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"parse_expression: unexpected character at {pos} in {text!r}")
        tokens.append(match.group(1))
        pos = match.end()
    items, end = _parse_group(tokens, 0, text)
    if end != len(tokens):
        raise ValueError(f"parse_expression: unexpected {tokens[end]!r} in {text!r}")
    return items


def _parse_group(tokens: list[str], pos: int, text: str) -> tuple[Items, int]:
    items: Items = []
    while True:
        if pos >= len(tokens):
            raise ValueError(f"parse_expression: expression ends early: {text!r}")
        if tokens[pos] == "(":
            group, pos = _parse_group(tokens, pos + 1, text)
            if pos >= len(tokens) or tokens[pos] != ")":
                raise ValueError(f"parse_expression: missing ')' in {text!r}")
            items.append(group)
        elif tokens[pos].isdigit():
            items.append(int(tokens[pos]))
        else:
            raise ValueError(f"parse_expression: expected a number or '(', got {tokens[pos]!r} in {text!r}")
        pos += 1
        if pos >= len(tokens) or tokens[pos] not in OPERATORS:
            return items, pos
        items.append(tokens[pos])
        pos += 1


def solve(items: Items, perturb: Callable[[int], int] | None = None) -> tuple[list[str], int]:
    """The worked steps ("a op b = c", one operation each) and the final value of `items`.

    `perturb(c) -> c'` replaces each step's true result before it is written and used by later steps; the noisy
    teacher of `scripts/build_tiny_model.py` uses it to make plausible mistakes that propagate to the answer.
    """
    steps: list[str] = []
    value = _reduce(items, steps, perturb or (lambda c: c))
    return steps, value


def _reduce(items: Items, steps: list[str], perturb: Callable[[int], int]) -> int:
    flat = [_reduce(x, steps, perturb) if isinstance(x, list) else x for x in items]
    for ops in _PRECEDENCE:
        reduced = [flat[0]]
        for op, b in zip(flat[1::2], flat[2::2]):
            if op in ops:
                a = reduced.pop()
                c = perturb(_APPLY[op](a, b))
                steps.append(f"{a} {op} {b} = {c}")
                reduced.append(c)
            else:
                reduced += [op, b]
        flat = reduced
    return flat[0]


def completion_text(steps: list[str], answer: int | str) -> str:
    """A completion in the task's format (what follows the prefill "<think>"), without the EOS token."""
    return "".join(f"{step}\n" for step in steps) + ANSWER_TEMPLATE.format(answer=answer)


def make_row(items: Items) -> dict:
    """The dataset row of one problem: prompt, answer (the integer as text), expression and a worked solution."""
    expression = format_items(items)
    steps, value = solve(items)
    return {
        "prompt": f"Calculate {expression}\n",
        "answer": str(value),
        "expression": expression,
        "gold_completion": completion_text(steps, value),
    }


def rows(
    split: str,
    n: int,
    seed: int = 0,
    difficulty: int = DEFAULT_DIFFICULTY,
    min_operands: int | None = None,
    max_operands: int | None = None,
    max_operand: int | None = None,
    paren_prob: float | None = None,
) -> list[dict]:
    """`n` rows of `split`; the held-out key is the expression text, so no test expression appears in train."""
    d = resolve_difficulty(difficulty, min_operands=min_operands, max_operands=max_operands,
                           max_operand=max_operand, paren_prob=paren_prob)

    def draw(rng: random.Random) -> tuple[str, dict]:
        row = make_row(sample_items(rng, d))
        return row["expression"], row

    return sample_rows("arithmetic", split, n, seed, draw)
