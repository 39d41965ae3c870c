"""Step rewards for process supervision (DeepSeekMath section 4.1.3).

A step-reward function has the outcome signature but returns, per completion, the list of its steps as
`(end, score)`: `end` is the exclusive character offset in the completion text where the step ends, `score` a float.
The trainer maps each `end` to the token that contains character `end - 1`. For a conversational completion the
offsets refer to `text.completion_text(completion)`.

`arithmetic_steps` is a rule-based step scorer for arithmetic chains of thought: every line that writes an
equation such as `12 * 3 = 36` is a step, checked exactly with the bounded evaluator of `safe_math`.
"""

import dataclasses
import re
from typing import ClassVar

from .base import ConfigurableReward
from .safe_math import ArithmeticRejected, NotArithmetic, evaluate, parse_arithmetic
from .text import completion_texts

# A run of arithmetic characters that contains an `=`; letters, ':' or tags end it, so "Step 2: 3 + 4 = 7" and
# "<think>2 + 12 = 14" yield "3 + 4 = 7" and "2 + 12 = 14".
_EQUATION = re.compile(r"[0-9.+\-*/()×÷−\s]*=[0-9.+\-*/()×÷−=\s]*")
_OPERATOR = re.compile(r"[0-9)]\s*[+\-*/]")  # a binary operator: "1 = 1" or "-3 = -3" is not a step
_TYPOGRAPHY = str.maketrans({"×": "*", "÷": "/", "−": "-"})


@dataclasses.dataclass(frozen=True)
class ArithmeticSteps(ConfigurableReward):
    """Score each equation line of a completion: `correct_score` when every `=` in it holds, else `wrong_score`.

    A line is a step when it contains an arithmetic equation with at least one binary operator whose sides all
    parse as arithmetic. A side that parses but cannot be evaluated safely (division by zero, a huge power) makes
    the step wrong. The step ends at the end of its line (newline excluded).
    """

    name: ClassVar[str] = "arithmetic_steps"
    correct_score: float = 1.0
    wrong_score: float = 0.0

    def __call__(self, completions: list, **kwargs) -> list[list[tuple[int, float]]]:
        """(B*G,) completions in; per completion, its steps as (end offset, score)."""
        return [self.steps(text) for text in completion_texts(completions)]

    def steps(self, text: str) -> list[tuple[int, float]]:
        found = []
        start = 0
        for line in text.split("\n"):
            end = start + len(line)
            verdict = _line_verdict(line)
            if verdict is not None:
                found.append((end, self.correct_score if verdict else self.wrong_score))
            start = end + 1
        return found


def _line_verdict(line: str) -> bool | None:
    """True / False for a line whose equations hold / fail, None for a line with no checkable equation."""
    if "=" not in line:
        return None
    verdicts = [_equation_verdict(m.group()) for m in _EQUATION.finditer(line)]
    verdicts = [v for v in verdicts if v is not None]
    return None if not verdicts else all(verdicts)


def _equation_verdict(run: str) -> bool | None:
    chain = run.translate(_TYPOGRAPHY)
    sides = [_trim(side) for side in chain.split("=")]
    if sides and not sides[0]:
        sides = sides[1:]  # "x = 12 * 3 = 36": the run starts at the first "="
    if len(sides) < 2 or not all(sides) or not _OPERATOR.search(chain):
        return None
    try:
        trees = [parse_arithmetic(side) for side in sides]
    except (NotArithmetic, ArithmeticRejected):
        return None
    try:
        values = [evaluate(tree) for tree in trees]
    except ArithmeticRejected:
        return False
    return all(value == values[0] for value in values)


def _trim(side: str) -> str:
    """Drop a sentence's final period and parentheses that belong to the prose: "(so 3 + 4 = 7)"."""
    side = side.strip().rstrip(".").strip()
    while side.startswith("(") and side.count("(") > side.count(")"):
        side = side[1:].strip()
    while side.endswith(")") and side.count(")") > side.count("("):
        side = side[:-1].strip()
    return side


arithmetic_steps = ArithmeticSteps()
