"""arithmetic_steps: which lines are steps, where each step ends, and how it is scored."""

import pytest

from grpo.rewards import ArithmeticSteps, arithmetic_steps, resolve_step_reward

CHAIN = "<think>2 + 12 = 14\nStep 2: 14 * 3 = 42.\nthen 5 - 1 = 3\nno equation here\n</think>\n<answer>42</answer>"


def test_steps_end_at_their_line_ends():
    # Line 0 "<think>2 + 12 = 14" is 18 chars: ends at 18. Line 1 starts at 19 and is 20 chars: ends at 39.
    # Line 2 starts at 40, "then 5 - 1 = 3" is 14 chars: ends at 54, and 5 - 1 = 4, not 3.
    assert arithmetic_steps([CHAIN]) == [[(18, 1.0), (39, 1.0), (54, 0.0)]]
    assert CHAIN[:18].endswith("14") and CHAIN[:39].endswith("42.") and CHAIN[:54].endswith("= 3")


@pytest.mark.parametrize(
    "line, steps",
    [
        ("12 * 3 = 36", [(11, 1.0)]),
        ("12 × 3 = 36", [(11, 1.0)]),  # typographic operators
        ("x = 12 * 3 = 36", [(15, 1.0)]),  # a chain after a variable
        ("12 * 3 = 36 = 6 * 7", [(19, 0.0)]),  # every '=' in the chain must hold
        ("(so 3 + 4 = 7) and then 2 * 2 = 5", [(33, 0.0)]),  # one wrong equation makes the line wrong
        ("1/0 = 3", [(7, 0.0)]),  # arithmetic that cannot be evaluated is wrong, not skipped
        ("9**9**9 = 5", [(11, 0.0)]),
        ("1 = 1", []),  # no operation: not a step
        ("x = 5", []),
        ("3x = 15", []),
        ("the answer is 42", []),
        ("1 + 1 =", []),
    ],
)
def test_line_table(line, steps):
    assert arithmetic_steps([line]) == [steps]


def test_settings_messages_and_registry():
    wrong_costs = ArithmeticSteps(wrong_score=-1.0)
    conversational = [[{"role": "assistant", "content": CHAIN}]]
    assert wrong_costs(conversational) == [[(18, 1.0), (39, 1.0), (54, -1.0)]]
    assert resolve_step_reward({"name": "arithmetic_steps", "wrong_score": -0.5})[1].wrong_score == -0.5
