"""Helpers shared by the built-in tasks: reproducible sampling and a train/test split that cannot overlap.

The split is decided by a hash of each problem's canonical key, not by the order in which problems are drawn, so
a problem belongs to the same split for every seed and every `n`: no held-out problem can ever appear in train.
Training rows are drawn independently (with replacement). Held-out rows are distinct problems, so an accuracy
over n held-out rows is over n different problems; a request for more distinct problems than the split holds is
an error that says so.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

SPLITS = ("train", "test")

# One problem in five is held out. Small enough that train keeps most of a small problem space (difficulty 1 of
# `arithmetic` has 243 problems), large enough that the test split of the default difficulty has ~1,400 problems.
TEST_FRACTION = 0.2

# Rejection sampling gives up after this many draws per requested row: only a problem space whose split is empty
# (or nearly so) can reach it, and then an error is better than a loop that never ends.
MAX_DRAWS_PER_ROW = 1000

# Every completion ends with this block; the seeds' format reward requires exactly "</think>\n<answer>...</answer>".
ANSWER_TEMPLATE = "</think>\n<answer>{answer}</answer>"


def split_of(key: str) -> str:
    """The split ("train" or "test") that a problem with canonical `key` belongs to, fixed for all seeds."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    unit = int.from_bytes(digest[:8], "big") / 2**64
    return "test" if unit < TEST_FRACTION else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {list(SPLITS)}")


def sample_rows(
    task: str, split: str, n: int, seed: int, draw: Callable[[random.Random], tuple[str, dict]]
) -> list[dict]:
    """Draw `n` rows of `split`, each from `draw(rng) -> (canonical_key, row)`, keeping those whose key is in `split`.

    The generator is seeded from (task, split, seed), so the same arguments always give the same rows, and the two
    splits of one seed are drawn from different streams.
    """
    check_split(split)
    if n < 0:
        raise ValueError(f"{task}.dataset: n must be >= 0, got {n}")
    rng = random.Random(f"{task}/{split}/{seed}")
    rows: list[dict] = []
    seen: set[str] = set()
    distinct = split == "test"
    for _ in range(max(n, 1) * MAX_DRAWS_PER_ROW):
        if len(rows) == n:
            return rows
        key, row = draw(rng)
        if split_of(key) == split and not (distinct and key in seen):
            seen.add(key)
            rows.append(row)
    if len(rows) == n:
        return rows
    raise ValueError(
        f"{task}.dataset: found only {len(rows)} of {n} {split!r} problems in {max(n, 1) * MAX_DRAWS_PER_ROW} draws "
        f"(held-out problems are distinct); "
        "the problem space of these knobs is too small for this split: widen it (e.g. a higher difficulty)"
    )
