"""The `countdown` task of TinyZero: reach `target` from `nums` with + - * /, each number used exactly once.

Follows Jiayi-Pan/TinyZero: the prompt sentence of `examples/data_preprocess/countdown.py` (`make_prefix`), 3 to 4
numbers as in its `Jiayi-Pan/Countdown-Tasks-3to4` data, and its reward `verl/utils/reward_score/countdown.py`,
which accepts an equation only if the numbers in it, sorted, equal `nums` sorted (every number exactly once) and it
evaluates to `target`. TinyZero's prompt says "can only be used once"; ours says "must be used exactly once",
which is what that reward checks.

Problems are generated, not downloaded: draw `nums`, combine them in a random order with random operators under the
rules of the Countdown game (every intermediate result a positive integer, so `-` never goes to zero or below and `/`
only divides exactly), and keep the result as `target` if it lies in 1..max_target. Every problem is therefore
solvable, and the row carries one solution (`expression`, and `gold_completion` with one step per line).

    prompt:     "Using the numbers [44, 19, 35], create an equation that equals 98. ...\\n"
    completion: "44 + 19 = 63\\n63 + 35 = 98\\n</think>\\n<answer>44 + 19 + 35</answer>"  (after the prefill "<think>")
"""

from __future__ import annotations

import random
from typing import Union

from grpo.tasks._common import ANSWER_TEMPLATE, sample_rows

# A solution tree: a number, or (operator, left, right).
Node = Union[int, tuple[str, "Node", "Node"]]

OPERATORS = ("+", "-", "*", "/")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
# How many random combinations to try on one draw of numbers before drawing new numbers, and how many draws of
# numbers to try before concluding that the knobs admit no problem.
_TRIES_PER_NUMS = 20
_MAX_NUMS_DRAWS = 10_000


def prompt_text(nums: list[int], target: int) -> str:
    """TinyZero's task sentence (its `make_prefix`), ending in a newline for the prefill "<think>" to follow."""
    return (
        f"Using the numbers {nums}, create an equation that equals {target}. "
        "You can use basic arithmetic operations (+, -, *, /) and each number must be used exactly once.\n"
    )


def _combine(a: int, op: str, b: int) -> int | None:
    """a op b under the Countdown rules (a positive integer result), or None when the rules forbid it."""
    if op == "+":
        return a + b
    if op == "*":
        return a * b
    if op == "-":
        return a - b if a > b else None
    return a // b if a % b == 0 else None


def random_solution(rng: random.Random, nums: list[int]) -> tuple[Node, int, list[str]] | None:
    """Combine all of `nums` at random: (tree, value, steps "a op b = c"), or None if a step broke the rules."""
    pool: list[tuple[int, Node]] = [(x, x) for x in nums]
    steps: list[str] = []
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        op = rng.choice(OPERATORS)
        (a, left), (b, right) = pool[i], pool[j]
        c = _combine(a, op, b)
        if c is None:
            return None
        steps.append(f"{a} {op} {b} = {c}")
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [(c, (op, left, right))]
    value, tree = pool[0]
    return tree, value, steps


def render(node: Node) -> str:
    """The expression of a tree, with only the parentheses precedence needs: ("-", 8, ("+", 1, 2)) -> 8 - (1 + 2)."""
    if isinstance(node, int):
        return str(node)
    op, left, right = node
    left_text, right_text = render(left), render(right)
    if not isinstance(left, int) and _PRECEDENCE[left[0]] < _PRECEDENCE[op]:
        left_text = f"({left_text})"
    if not isinstance(right, int) and (
        _PRECEDENCE[right[0]] < _PRECEDENCE[op] or (_PRECEDENCE[right[0]] == _PRECEDENCE[op] and op in "-/")
    ):
        right_text = f"({right_text})"
    return f"{left_text} {op} {right_text}"


def draw_problem(rng: random.Random, min_count: int, max_count: int, max_number: int, max_target: int) -> dict:
    """One solvable problem as a dataset row: prompt, target, nums, expression (a solution), gold_completion."""
    count = rng.randint(min_count, max_count)  # drawn once, so harder counts are not under-represented
    for _ in range(_MAX_NUMS_DRAWS):
        nums = [rng.randint(1, max_number) for _ in range(count)]
        for _ in range(_TRIES_PER_NUMS):
            found = random_solution(rng, nums)
            if found is not None and 1 <= found[1] <= max_target:
                tree, target, steps = found
                expression = render(tree)
                return {
                    "prompt": prompt_text(nums, target),
                    "target": target,
                    "nums": nums,
                    "expression": expression,
                    "gold_completion": "".join(f"{s}\n" for s in steps) + ANSWER_TEMPLATE.format(answer=expression),
                }
    raise ValueError(
        f"countdown: no target in 1..{max_target} found for {min_count}-{max_count} numbers in 1..{max_number}; "
        "raise max_target or lower max_number"
    )


def rows(
    split: str, n: int, seed: int = 0, min_count: int = 3, max_count: int = 4, max_number: int = 99,
    max_target: int = 100,
) -> list[dict]:
    """`n` rows of `split`; the held-out key is (target, sorted nums): no reordering of a test problem is in train."""
    if not 2 <= min_count <= max_count:
        raise ValueError(f"countdown: need 2 <= min_count <= max_count, got {min_count}, {max_count}")
    if max_number < 1 or max_target < 1:
        raise ValueError(f"countdown: max_number and max_target must be >= 1, got {max_number}, {max_target}")

    def draw(rng: random.Random) -> tuple[str, dict]:
        row = draw_problem(rng, min_count, max_count, max_number, max_target)
        return f"{row['target']}|{sorted(row['nums'])}", row

    return sample_rows("countdown", split, n, seed, draw)
