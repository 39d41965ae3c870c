"""Countdown: write an equation from the given numbers that reaches the target (seed tutorials 000/001, TinyZero).

The seeds evaluate the answer with `eval`; here the bounded evaluator of `safe_math` does it, so `9**9**9**9`,
`__import__('os')`, Unicode digits or 1000 nested parentheses score 0 in microseconds (reliability.md 2.3-2.4).
"""

import dataclasses
from collections import Counter
from fractions import Fraction
from typing import ClassVar

from .base import ConfigurableReward
from .format import parse_think_answer
from .safe_math import ArithmeticRejected, Limits, NotArithmetic, evaluate, literals, parse_arithmetic
from .text import completion_texts


@dataclasses.dataclass(frozen=True)
class Countdown(ConfigurableReward):
    """Reward 1.0 when the `<answer>` equation uses the allowed numbers and equals the target.

    Settings:
        exact_use: each given number must be used exactly once (TinyZero's rule). False (the seeds' rule): every
            number written must be one of the given numbers; numbers may be left out or used again.
        allow_power: also accept `**`. The game's operators are + - * /; the seeds' character regex admits `**`
            only by accident. When on, exponents stay bounded by `safe_math.Limits`.
        format_score: reward for a well-formatted answer that is wrong (TinyZero uses 0.1; the seeds 0.0).
        target_column, numbers_column: dataset columns holding the target and the list of numbers.
    Completions without the `<think>...</think>\\n<answer>...</answer>` layout score 0.0, as in the seeds.
    """

    name: ClassVar[str] = "countdown"
    exact_use: bool = False
    allow_power: bool = False
    format_score: float = 0.0
    correct_score: float = 1.0
    target_column: str = "target"
    numbers_column: str = "nums"

    @property
    def column_requirements(self) -> tuple[tuple[str, ...], ...]:
        return ((self.target_column,), (self.numbers_column,))

    def __call__(self, completions: list, **kwargs) -> list[float]:
        """(B*G,) completions and columns in, (B*G,) rewards out."""
        targets, numbers = kwargs[self.target_column], kwargs[self.numbers_column]
        return [
            self.score(text, target, nums)
            for text, target, nums in zip(completion_texts(completions), targets, numbers, strict=True)
        ]

    def score(self, text: str, target, numbers) -> float:
        """Score one completion against its target and list of numbers."""
        answer = parse_think_answer(text)
        if answer is None:
            return 0.0
        limits = Limits(allow_power=self.allow_power)
        try:
            tree = parse_arithmetic(answer, limits)
            value = evaluate(tree, limits)
        except (NotArithmetic, ArithmeticRejected):
            return self.format_score
        if not self._uses_allowed_numbers(literals(tree), numbers):
            return self.format_score
        return self.correct_score if value == Fraction(str(target).strip()) else self.format_score

    def _uses_allowed_numbers(self, used: list[Fraction], given) -> bool:
        allowed = [Fraction(str(n)) for n in given]
        if self.exact_use:
            return Counter(used) == Counter(allowed)
        return all(number in allowed for number in used)


countdown = Countdown()
