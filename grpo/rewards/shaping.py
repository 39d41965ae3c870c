"""Shaping rewards from open-r1 and TRL: length-scaled accuracy, n-gram repetition, soft overlong punishment."""

import dataclasses
import math
from typing import ClassVar

from .base import ConfigurableReward
from .math_accuracy import MathAccuracy
from .text import completion_texts


@dataclasses.dataclass(frozen=True)
class CosineLength(ConfigurableReward):
    """open-r1 `get_cosine_scaled_reward`: correctness scaled by completion length on a cosine schedule.

    With p = min(len / max_len, 1) (len in characters, as upstream) and c = cos(p * pi):
        correct: min_value_correct + (max_value_correct - min_value_correct) * (1 + c) / 2  (short is better)
        wrong:   max_value_wrong + (min_value_wrong - max_value_wrong) * (1 + c) / 2       (long is penalized less)
    Departures: p is clamped at 1 (upstream lets the cosine climb back past max_len), and an unparseable gold
    answer gives None (upstream gives 1.0 to "skip" it). Correctness comes from `math_accuracy`.
    """

    name: ClassVar[str] = "cosine_length"
    min_value_wrong: float = -1.0
    max_value_wrong: float = -0.5
    min_value_correct: float = 0.5
    max_value_correct: float = 1.0
    max_len: int = 1000
    gold_columns: tuple[str, ...] = ("solution", "answer")

    def __post_init__(self):
        super().__post_init__()
        if self.max_len <= 0:
            raise ValueError(f"cosine_length: max_len must be positive, got {self.max_len}")

    @property
    def column_requirements(self) -> tuple[tuple[str, ...], ...]:
        return (self.gold_columns,)

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        """(B*G,) completions and a gold column in, (B*G,) rewards out."""
        texts = completion_texts(completions)
        correct = MathAccuracy(gold_columns=self.gold_columns)(texts, **kwargs)
        return [None if ok is None else self.scale(len(text), ok == 1.0) for text, ok in zip(texts, correct)]

    def scale(self, length: int, correct: bool) -> float:
        cosine = math.cos(min(length / self.max_len, 1.0) * math.pi)
        if correct:
            low, high = self.min_value_correct, self.max_value_correct
        else:
            low, high = self.max_value_wrong, self.min_value_wrong  # swapped: a long wrong answer is penalized less
        return low + 0.5 * (high - low) * (1.0 + cosine)


@dataclasses.dataclass(frozen=True)
class RepetitionPenalty(ConfigurableReward):
    """open-r1 `get_repetition_penalty_reward` (Yeo et al. 2025, arXiv 2502.03373, appendix C.2).

    reward = (1 - distinct n-grams / total n-grams) * max_penalty over lower-cased whitespace words; 0.0 for a
    text shorter than one n-gram. English word split only (upstream's Chinese mode needs `jieba`).
    """

    name: ClassVar[str] = "repetition_penalty"
    ngram_size: int = 3
    max_penalty: float = -1.0

    def __post_init__(self):
        super().__post_init__()
        if self.max_penalty > 0:
            raise ValueError(f"repetition_penalty: max_penalty must not be positive, got {self.max_penalty}")
        if self.ngram_size < 1:
            raise ValueError(f"repetition_penalty: ngram_size must be at least 1, got {self.ngram_size}")

    def __call__(self, completions: list, **kwargs) -> list[float]:
        """(B*G,) completions in, (B*G,) rewards in [max_penalty, 0] out."""
        return [self.penalty(text) for text in completion_texts(completions)]

    def penalty(self, text: str) -> float:
        words = text.lower().split()
        if len(words) < self.ngram_size:
            return 0.0
        ngrams = list(zip(*[words[i:] for i in range(self.ngram_size)]))
        return (1 - len(set(ngrams)) / len(ngrams)) * self.max_penalty


@dataclasses.dataclass(frozen=True)
class SoftOverlong(ConfigurableReward):
    """DAPO overlong reward shaping (arXiv 2503.14476, eq. 13; TRL `get_soft_overlong_punishment`).

    With L the completion length in tokens, L_max = max_length and L_cache = cache_length:
        0 if L <= L_max - L_cache;  (L_max - L_cache - L) / L_cache if L_max - L_cache < L <= L_max;  -1 beyond.
    Defaults are the paper's (16 384 expected maximum, 4 096 cache); set max_length to the run's completion limit.
    """

    name: ClassVar[str] = "soft_overlong"
    max_length: int = 16384
    cache_length: int = 4096

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.cache_length <= self.max_length:
            raise ValueError(
                f"soft_overlong: need 0 < cache_length <= max_length, got {self.cache_length} and {self.max_length}"
            )

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        """(B*G,) token-id lists in, (B*G,) rewards in [-1, 0] out."""
        return [self.penalty(len(ids)) for ids in completion_ids]

    def penalty(self, length: int) -> float:
        start = self.max_length - self.cache_length
        if length <= start:
            return 0.0
        if length <= self.max_length:
            return (start - length) / self.cache_length
        return -1.0


cosine_length = CosineLength()
repetition_penalty = RepetitionPenalty()
soft_overlong = SoftOverlong()


@dataclasses.dataclass(frozen=True)
class KimiLength(ConfigurableReward):
    """open-r1's `length` (`len_reward`, Kimi 1.5, arXiv:2501.12599): with lam = 0.5 - (len - min) / (max - min) over
    the call's completions (characters), lam for a correct answer and min(0, lam) for a wrong one; all 0 when every
    completion has the same length. Correctness is math_accuracy's; a gold answer it cannot read counts as correct
    (open-r1's rule: never penalised for the data)."""

    name: ClassVar[str] = "kimi_length"
    gold_columns: tuple[str, ...] = ("solution", "answer")

    @property
    def column_requirements(self) -> tuple[tuple[str, ...], ...]:
        return (self.gold_columns,)

    def __call__(self, completions: list, **kwargs) -> list[float]:
        texts = completion_texts(completions)
        lengths = [len(t) for t in texts]
        low, high = min(lengths), max(lengths)
        if high == low:
            return [0.0] * len(texts)
        column = next(c for c in self.gold_columns if c in kwargs)
        correct = [score is None or score >= 1.0 for score in MathAccuracy().check(texts, kwargs[column])]
        lams = [0.5 - (n - low) / (high - low) for n in lengths]
        return [lam if ok else min(0.0, lam) for lam, ok in zip(lams, correct)]


kimi_length = KimiLength()
