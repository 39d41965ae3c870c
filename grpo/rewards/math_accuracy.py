"""Math answer accuracy: extract the final answer, compare it with the gold answer, never hang.

Order of work per completion (each step only when the previous one cannot decide):
1. extract the answer: the last `<answer>...</answer>`, the last `\\boxed{...}` (inside the answer if there is one),
   or the text after the last `####` (GSM8K);
2. fast path: when gold and answer are both plain numbers (integer, decimal, `a/b`, `\\frac{a}{b}`), compare them
   exactly in this process, in microseconds; the arithmetic task relies on this;
3. pre-filter: an answer longer than 1000 characters, or with a power tower, a six-digit exponent, a huge factorial
   or 50 nested brackets, that the gold does not have, scores 0 without being parsed (reliability.md 2.2,
   recommendation 3);
4. math-verify in a killable worker process with a hard per-answer deadline (`math_worker.py`).
A gold answer that math-verify cannot parse gives `None` (the sample is skipped, as in TRL's `accuracy_reward`).
"""

import atexit
import dataclasses
import re
import threading
from fractions import Fraction
from typing import ClassVar

from .base import ConfigurableReward
from .math_worker import MathVerifyWorker
from .text import completion_texts

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")

_NUMBER = r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|[+-]?\.[0-9]+"
_PLAIN_NUMBER = re.compile(_NUMBER)
_RATIO = re.compile(rf"({_NUMBER})\s*/\s*({_NUMBER})")
_LATEX_FRACTION = re.compile(rf"([+-]?)\\[dt]?frac\s*\{{\s*({_NUMBER})\s*\}}\s*\{{\s*({_NUMBER})\s*\}}")

# Inputs that make sympy work for minutes or allocate gigabytes (reliability.md 2.2), recognised by shape.
_EXPLOSIVE = [
    re.compile(r"\^\s*\{[^{}]*\^"),  # 9^{9^{9}}, 5^{\left(5^{...}\right)}
    re.compile(r"(?:\^|\*\*)\s*\(?\s*[0-9.]+\s*\)?\s*(?:\^|\*\*)"),  # 9^9^9, 9**9**9
    re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[0-9]{6,}"),  # 7^{1000000000}
    re.compile(r"(?:[0-9]{4,}|\})\s*!"),  # 10000!, 10^{10}!
]
MAX_BRACKET_DEPTH = 50
MAX_ANSWER_CHARS = 1000  # for an extracted answer; a whole completion (no answer marked) may be longer


def extract_answer(text: str) -> str | None:
    """The final answer written in `text`, or None when it marks none (no tag, no box, no `####`)."""
    tags = _ANSWER_TAG.findall(text)
    scope = tags[-1] if tags else text
    boxed = last_boxed(scope)
    if boxed is not None:
        return boxed.strip()
    if tags:
        return scope.strip()
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[start:position]
    return None


def plain_number(text: str) -> Fraction | None:
    """The value of an answer written as a plain number (`12`, `-3.5`, `1,000`, `3/4`, `\\frac{3}{4}`), else None."""
    s = text.strip().strip("$").strip()
    s = s[:-1].rstrip() if s.endswith(".") else s
    if len(s) > 64:
        return None
    if _PLAIN_NUMBER.fullmatch(s):
        return _fraction(s)
    ratio = _RATIO.fullmatch(s)
    latex = _LATEX_FRACTION.fullmatch(s)
    if ratio:
        sign, numerator, denominator = "", ratio.group(1), ratio.group(2)
    elif latex:
        sign, numerator, denominator = latex.groups()
    else:
        return None
    denominator_value = _fraction(denominator)
    if denominator_value == 0:
        return None
    value = _fraction(numerator) / denominator_value
    return -value if sign == "-" else value


def _fraction(number: str) -> Fraction:
    return Fraction(number.replace(",", ""))


def looks_explosive(text: str) -> bool:
    """True for answers shaped like the ones that hang or exhaust sympy (power towers, huge exponents, ...)."""
    if any(pattern.search(text) for pattern in _EXPLOSIVE):
        return True
    depth = deepest = 0
    for char in text:
        depth += (char in "({[") - (char in ")}]")
        deepest = max(deepest, depth)
    return deepest > MAX_BRACKET_DEPTH


def _refused(answer: str | None, text: str) -> bool:
    if answer is not None and len(answer) > MAX_ANSWER_CHARS:
        return True
    return looks_explosive(text if answer is None else answer)


def _candidates(answer: str) -> list[str]:
    # math-verify extracts LaTeX reliably only behind an anchor: bare `\sqrt{2}` parses to nothing, `$\sqrt{2}$` works.
    return [answer] if "$" in answer else [f"${answer}$", answer]


_worker: MathVerifyWorker | None = None
_worker_lock = threading.Lock()


def shared_worker() -> MathVerifyWorker:
    """The math-verify worker process of this trainer process (one for every math reward), started on first use."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = MathVerifyWorker()
            atexit.register(_worker.close)
        return _worker


@dataclasses.dataclass(frozen=True)
class MathAccuracy(ConfigurableReward):
    """1.0 when the completion's final answer equals the gold answer, 0.0 when not, None when the gold is unparseable.

    Settings:
        timeout_s: hard deadline for one math-verify check; past it the worker is killed and the answer scores 0.
        prefilter: score answers shaped like known sympy bombs 0 without parsing them (unless the gold has the shape).
        gold_columns: dataset columns that may hold the gold answer, first present wins (TRL/open-r1 use `solution`).
    """

    name: ClassVar[str] = "math_accuracy"
    timeout_s: float = 5.0
    prefilter: bool = True
    gold_columns: tuple[str, ...] = ("solution", "answer")

    def __post_init__(self):
        super().__post_init__()
        if self.timeout_s < 1:
            raise ValueError(f"math_accuracy: timeout_s must be at least 1 second, got {self.timeout_s}")

    @property
    def column_requirements(self) -> tuple[tuple[str, ...], ...]:
        return (self.gold_columns,)

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        """(B*G,) completions and a gold column in, (B*G,) rewards out."""
        column = next((name for name in self.gold_columns if name in kwargs), None)
        if column is None:
            raise KeyError(f"math_accuracy needs a gold-answer column: one of {', '.join(self.gold_columns)}")
        return self.check(completion_texts(completions), kwargs[column])

    def check(self, texts: list[str], golds: list) -> list[float | None]:
        """Score each text against its gold answer; (N,) texts and golds in, (N,) scores out."""
        scores: list[float | None] = []
        pending: dict[int, dict] = {}
        for index, (text, gold) in enumerate(zip(texts, golds, strict=True)):
            score, request = self._plan(text, gold)
            scores.append(score)
            if request is not None:
                pending[index] = request
        if pending:
            verdicts = shared_worker().check(list(pending.values()), self.timeout_s)
            for index, verdict in zip(pending, verdicts):
                scores[index] = None if verdict is None else float(verdict)
        return scores

    def _plan(self, text: str, gold) -> tuple[float | None, dict | None]:
        """A final score, or a math-verify request for the worker."""
        gold_text = "" if gold is None else str(gold)
        gold_answer = extract_answer(gold_text) or gold_text.strip()
        if not gold_answer:
            return None, None
        answer = extract_answer(text)
        if answer == "":
            return 0.0, None
        gold_value = plain_number(gold_answer)
        if gold_value is not None and answer is not None:
            answer_value = plain_number(answer)
            if answer_value is not None:
                return float(answer_value == gold_value), None
        if self.prefilter and _refused(answer, text) and not _refused(gold_answer, gold_answer):
            return 0.0, None
        gold_candidates = list(dict.fromkeys(_candidates(gold_answer) + [gold_text]))
        prediction = {"pred": _candidates(answer), "anchored": False} if answer else {"pred": [text], "anchored": True}
        return None, {"gold": gold_candidates, **prediction}


math_accuracy = MathAccuracy()
