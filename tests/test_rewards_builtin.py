"""Rule-based built-ins: the seeds' own test vectors, open-r1/TRL definitions, hostile countdown answers."""

import math
import time

import pytest

from grpo.rewards import (
    CosineLength,
    Countdown,
    RepetitionPenalty,
    SoftOverlong,
    cosine_length,
    countdown,
    reasoning_steps,
    repetition_penalty,
    soft_overlong,
    tag_count,
    think_format,
)

# The six samples of seeds 000/001, verbatim.
SEED_SAMPLES = [
    "Let's use the numbers 4, 8, 2, and 1 to get 15. \n"  # the seed's line ends with a space
    "We can try: 8 * 2 - 1 = 15... </think>\n"
    "<answer> 8 * 2 - 1 </answer>",
    """ ... </think>
<answer> 8 * 2 - 1 </answer>""",
    """Using 4, 8, 2, 1, make 15: 8 * 2 - 1 = 15""",
    """<answer> 8 + 4 + 2 + 1 </answer>
<think> This should equal 15 </think>""",
    """ ... </think>
<answer> 8 + 4 - 2 </answer>""",
    """ ... </think>
<answer> 10 * 2 - 5 </answer>""",
]
SEED_COLUMNS = {"target": ["15"] * 6, "nums": [[4, 8, 2, 1]] * 6}


def as_messages(texts):
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_think_format_reproduces_the_seed_vector():
    assert think_format(SEED_SAMPLES, **SEED_COLUMNS) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert think_format(as_messages(SEED_SAMPLES), **SEED_COLUMNS) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "text, reward",
    [
        ("<think>a</think>\n<answer>b</answer>", 1.0),
        ("a</think>\n<answer>b</answer>", 1.0),  # the prompt opened <think>
        ("<think>a</think><answer>b</answer>", 0.0),  # the newline between the blocks is required
        ("<think>a<think>b</think>\n<answer>c</answer>", 0.0),  # no nested <think>
        ("<think>a</think>\n<answer>b</answer> trailing", 0.0),
        ("", 0.0),
    ],
)
def test_think_format_table(text, reward):
    assert think_format([text]) == [reward]


def test_countdown_reproduces_the_seed_vector():
    assert countdown(SEED_SAMPLES, **SEED_COLUMNS) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert countdown(as_messages(SEED_SAMPLES), **SEED_COLUMNS) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def answer(equation: str) -> str:
    return f"...</think>\n<answer>{equation}</answer>"


@pytest.mark.parametrize(
    "equation, subset, exact",
    [
        ("8 * 2 - 1", 1.0, 0.0),  # leaves 4 out: allowed only when numbers may be skipped
        ("(8 - 4 + 1) * 2 + 8 - 3", 0.0, 0.0),  # 3 is not given
        ("8 * 2 - 1 + 4 - 4", 1.0, 0.0),  # reuses 4: the seed's rule allows it, exact use does not
        ("4 * 2 + 8 - 1", 1.0, 1.0),  # 8 + 8 - 1 = 15, every number once
        ("(4 + 1) * (8 / 2) - 5", 0.0, 0.0),  # 5 not given
        ("8 / (4 - 4)", 0.0, 0.0),  # division by zero scores 0
    ],
)
def test_countdown_number_use_setting(equation, subset, exact):
    columns = {"target": [15], "nums": [[4, 8, 2, 1]]}
    assert countdown([answer(equation)], **columns) == [subset]
    assert Countdown(exact_use=True)([answer(equation)], **columns) == [exact]
    assert countdown.configure(exact_use=True)([answer(equation)], **columns) == [exact]


def test_countdown_settings_columns_and_format_score():
    tinyzero = Countdown(exact_use=True, format_score=0.1, target_column="goal", numbers_column="numbers")
    columns = {"goal": [15, 15], "numbers": [[4, 8, 2, 1]] * 2}
    assert tinyzero([answer("4 * 2 + 8 - 1"), answer("4 + 8 + 2 + 1 + 0")], **columns) == [1.0, 0.1]
    assert tinyzero.column_requirements == (("goal",), ("numbers",))
    with pytest.raises(ValueError, match="no setting 'exact'"):
        countdown.configure(exact=True)


# Hostile answers through the whole countdown reward, with numbers that the checks of the seeds would accept.
COUNTDOWN_CORPUS = [
    "9**9**9**9",
    "99999**3999999",
    "95**21**3**54",
    "(" * 1000 + "9" + ")" * 1000,
    "٤٢ + 1",
    "__import__('os').system('x')",
    "(9).real",
    "nums",
    "print(9)",
    "(lambda: 9)()",
    "'9' * 9",
    "-" * 100_000 + "9",
    "9 % 9 + 9",
]


def test_countdown_adversarial_corpus_scores_zero_quickly():
    columns = {"target": ["9"], "nums": [[9, 3, 54, 95, 21, 99999, 3999999, 1]]}
    worst = 0.0
    for equation in COUNTDOWN_CORPUS:
        for reward in (countdown, Countdown(allow_power=True)):
            start = time.perf_counter()
            assert reward([answer(equation)], **columns) == [0.0], equation
            worst = max(worst, time.perf_counter() - start)
    assert worst < 0.1  # measured: well under a millisecond each


def test_countdown_power_when_allowed():
    columns = {"target": [16], "nums": [[2, 4]]}
    assert countdown([answer("2 ** 4")], **columns) == [0.0]
    assert Countdown(allow_power=True)([answer("2 ** 4")], **columns) == [1.0]


@pytest.mark.parametrize(
    "text, reward",
    [
        ("<think>\nx\n</think>\n<answer>\ny\n</answer>", 1.0),  # all four tags with their newlines
        ("<think>\nx\n</think>\n<answer>y</answer>", 0.5),  # "\n<answer>\n" and "\n</answer>" missing
        ("<think>x</think>", 0.0),
        ("<think>\n<think>\nx\n</think>\n<answer>\ny\n</answer>", 0.75),  # "<think>\n" twice: that quarter lost
    ],
)
def test_tag_count_table(text, reward):
    assert tag_count([text]) == [reward]


@pytest.mark.parametrize(
    "text, reward",
    [
        ("Step 1: a\nStep 2: b\nStep 3: c", 1.0),
        ("First, a. Next, b.", 2 / 3),
        ("1. a\n2. b", 1 / 3),  # as upstream, `^\d+\.` counts only at the start of the text
        ("\n- a\n- b\n* c\nFinally, d", 1.0),  # 4 markers, capped at 1
        ("no markers", 0.0),
    ],
)
def test_reasoning_steps_table(text, reward):
    assert reasoning_steps([text]) == pytest.approx([reward])


def test_cosine_length_values():
    # max_len 100. Correct, length 0: cos(0) = 1 -> 0.5 + 0.5 * (1.0 - 0.5) * 2 = 1.0 (max_value_correct).
    # Correct, length 50: cos(pi/2) = 0 -> 0.5 + 0.25 = 0.75. Correct, length >= 100: cos(pi) = -1 -> 0.5.
    # Wrong, length 50: low = max_value_wrong = -0.5, high = min_value_wrong = -1 -> -0.5 + 0.5 * (-0.5) = -0.75.
    # Wrong, length 200: clamped at p = 1 -> -0.5 (upstream would climb back towards -1).
    reward = CosineLength(max_len=100)
    right, wrong = "<answer>7</answer>", "<answer>8</answer>"
    texts = [right, right.ljust(50), right.ljust(100), wrong.ljust(50), wrong.ljust(200)]
    expected = [reward.scale(len(right), True), 0.75, 0.5, -0.75, -0.5]
    assert reward(texts, solution=["7"] * 5) == pytest.approx(expected)
    assert reward.scale(0, True) == pytest.approx(1.0)
    assert cosine_length.configure(max_len=100) == reward


def test_cosine_length_skips_rows_without_gold():
    assert cosine_length(["<answer>7</answer>"], answer=[""]) == [None]


def test_repetition_penalty_values():
    # 3-grams of "a b a b a b": (a b a), (b a b), (a b a), (b a b): 2 distinct of 4 -> (1 - 2/4) * -1 = -0.5.
    # "one two three four": 2 distinct of 2 -> 0. "a b": fewer words than n -> 0.
    assert repetition_penalty(["a b a b a b", "one two three four", "a b", ""]) == [-0.5, 0.0, 0.0, 0.0]
    # 2-grams of "A a a": (a a), (a a): 1 distinct of 2 -> (1 - 1/2) * -2 = -1.0 (lower-cased first).
    assert RepetitionPenalty(ngram_size=2, max_penalty=-2.0)(["A a a"]) == [-1.0]
    with pytest.raises(ValueError, match="must not be positive"):
        RepetitionPenalty(max_penalty=0.5)


def test_soft_overlong_values():
    # L_max = 10, L_cache = 4: penalty starts after 6 tokens; 8 tokens -> (6 - 8) / 4 = -0.5; 10 -> -1; 11 -> -1.
    reward = SoftOverlong(max_length=10, cache_length=4)
    ids = [[0] * n for n in (0, 6, 7, 8, 10, 11)]
    assert reward(completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert soft_overlong(completion_ids=[[0] * 12288, [0] * 16384]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="cache_length"):
        SoftOverlong(max_length=4, cache_length=8)


def test_builtins_accept_message_lists():
    text = "<think>\nStep 1: a\n</think>\n<answer>\n7\n</answer>"
    for reward in (tag_count, reasoning_steps, repetition_penalty):
        assert reward(as_messages([text])) == reward([text])
    assert not math.isnan(cosine_length(as_messages([text]), solution=["7"])[0])
