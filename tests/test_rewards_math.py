"""math_accuracy: extraction, the in-process fast path, math-verify in a killable worker, hostile answers."""

import os
import threading
import time
from fractions import Fraction

import pytest

from grpo.rewards import MathAccuracy, math_accuracy
from grpo.rewards.math_accuracy import extract_answer, looks_explosive, plain_number, shared_worker
from grpo.rewards.math_worker import MathVerifyWorker

HANG_GUARD_S = 15  # generous: only catches a hang; the measured worst case is printed by the corpus test


def child_pids() -> set[int]:
    """Live child processes of this test process (Linux /proc)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                pids.add(int(entry))
    return pids


@pytest.fixture(scope="module")
def worker():
    """The shared math-verify worker, started once for this module and closed (and checked gone) at the end."""
    before = child_pids()
    yield shared_worker()
    shared_worker().close()
    assert child_pids() <= before, "a math-verify process was left behind"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>x</think>\n<answer> 42 </answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last answer tag
        ("<answer>so \\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),  # a box inside the answer wins
        ("we get \\boxed{3} and finally \\boxed{x^{2}}", "x^{2}"),  # the last box, braces balanced
        ("work\n#### 1,234\n", "1,234"),  # GSM8K
        ("\\boxed{1", None),  # unbalanced
        ("no marker 42", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", Fraction(42)),
        (" -3.5 ", Fraction(-7, 2)),
        ("$1,000$", Fraction(1000)),
        ("3/4", Fraction(3, 4)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\dfrac{6}{8}", Fraction(3, 4)),
        ("7.", Fraction(7)),
        ("1/0", None),
        ("٤٢", None),
        ("x = 5", None),
        ("2^{10}", None),
    ],
)
def test_plain_number(text, value):
    assert plain_number(text) == value


def test_fast_path_needs_no_worker():
    shared_worker().close()
    completions = ["<answer>42</answer>", "<answer>41</answer>", "\\boxed{0.5}", "#### 1,000"]
    start = time.perf_counter()
    assert math_accuracy(completions, solution=["42", "42", "1/2", "1000"]) == [1.0, 0.0, 1.0, 1.0]
    assert time.perf_counter() - start < 0.05  # measured: about 0.2 ms
    assert shared_worker().pid is None


def test_math_verify_equivalence(worker):
    completions = [
        "<answer>\\sqrt{8}</answer>",
        "<answer>x = 2\\sqrt{2}</answer>",
        "\\boxed{2\\sqrt{3}}",
        "The final answer is $2\\sqrt{2}$.",  # no tag, no box: math-verify's own anchors, as in TRL
        [{"role": "assistant", "content": "\\boxed{\\frac{4}{\\sqrt{2}}}"}],
    ]
    assert math_accuracy(completions, solution=["$2\\sqrt{2}$"] * 5) == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_gold_column_choice_and_unparseable_gold(worker):
    completion = ["<answer>5</answer>"]
    assert math_accuracy(completion, solution=["5"], answer=["6"]) == [1.0]  # `solution` wins
    assert math_accuracy(completion, answer=["6"]) == [0.0]
    assert math_accuracy(completion, solution=["The full solution ... #### 5"]) == [1.0]
    assert math_accuracy(completion, solution=[""]) == [None]
    assert math_accuracy(completion, solution=["\\"]) == [None]  # math-verify parses nothing
    assert MathAccuracy(gold_columns=["target"])(completion, target=["5"]) == [1.0]
    with pytest.raises(KeyError, match="solution, answer"):
        math_accuracy(completion, gold=["5"])


MV65 = "\\boxed{\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}}"
MATH_CORPUS = [
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{7^{1000000000}}",
    "\\boxed{2^{2^{34}}}",
    "\\boxed{10^{10^{10}}}",
    MV65,  # huggingface/Math-Verify#65: hung for more than 60 s in the main thread (reliability.md 2.2)
    "\\boxed{10^{10}!}",
    "\\boxed{\\binom{10^{12}}{10^{6}}}",
    "\\boxed{\\sum_{n=1}^{10^9} n^n}",
    "\\boxed{\\sqrt{\\sqrt{\\sqrt{\\sqrt{2^{2^{30}}}}}}}",
    "<answer>9**9**9**9</answer>",
    "<answer>" + "(" * 2000 + "1" + ")" * 2000 + "</answer>",
    "<answer>" + "+".join(["1"] * 20_000) + "</answer>",
    "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}",
    "x" * 200_000 + "\\boxed{42}",
    "\\boxed{1}" * 20_000,
    "\\boxed{٤٢}",
    "\\boxed{４２}",
    "\\boxed{}",
    "\\boxed{4",
    "\\text{\\boxed{42}}",
    "<answer>4\x002</answer>",
    "<answer>__import__('os').system('x')</answer>",
]


@pytest.mark.parametrize("prefilter, corpus", [(True, MATH_CORPUS), (False, MATH_CORPUS[:5])])
def test_adversarial_corpus_is_bounded(worker, prefilter, corpus):
    """Every hostile answer gets a reward (0.0 or 1.0 for the honest `42`s) within the hang guard.

    Without the pre-filter, the first five (power towers, Math-Verify#65) reach math-verify in the worker.
    """
    reward = MathAccuracy(prefilter=prefilter, timeout_s=3.0)
    latencies = []
    for completion in corpus:
        start = time.perf_counter()
        [score] = reward([completion], solution=["42"])
        latencies.append(time.perf_counter() - start)
        assert score in (0.0, 1.0), completion[:40]
        assert latencies[-1] < HANG_GUARD_S, completion[:40]
    print(f"\nmath corpus: {len(corpus)} answers, prefilter={prefilter}, worst {max(latencies):.2f} s")


def test_corpus_from_a_thread(worker):
    """The async-reward path: math-verify's alarms fail off the main thread, the worker's deadline does not."""
    scores = []
    thread = threading.Thread(
        target=lambda: scores.extend(
            MathAccuracy(prefilter=False, timeout_s=3.0)(
                ["\\boxed{2^{2^{34}}}", "<answer>\\frac{1}{2}</answer>"], answer=["42", "0.5"]
            )
        )
    )
    start = time.perf_counter()
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive() and time.perf_counter() - start < HANG_GUARD_S
    assert scores == [0.0, 1.0]


def test_deadline_kills_and_replaces_the_worker():
    # math-verify's own alarm (10 s) is set past the deadline (1 s), so only the kill can end this request.
    own = MathVerifyWorker()
    try:
        slow = {"gold": ["$42$"], "pred": ["$2^{2^{34}}$"], "anchored": False}
        assert own.check([{"gold": ["$1$"], "pred": ["$1$"], "anchored": False}], timeout_s=30) == [True]
        first_pid = own.pid
        start = time.perf_counter()
        assert own.check([slow], timeout_s=1.0, inner_timeout_s=10) == [False]
        assert time.perf_counter() - start < 3
        assert own.timeouts == 1 and own.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)
        assert own.check([{"gold": ["$1/2$"], "pred": ["$0.5$"], "anchored": False}], timeout_s=30) == [True]
        assert own.starts == 2
    finally:
        own.close()


def test_looks_explosive_spares_ordinary_answers():
    for ordinary in ("x^{2} + 1", "2^{10}", "10^{6}", "\\frac{n(n+1)}{2}", "3!", "e^{i\\pi}"):
        assert not looks_explosive(ordinary), ordinary
    for bomb in ("9^{9^{9}}", "7^{1000000}", "9**9**9", "10^{10}!", "(" * 60):
        assert looks_explosive(bomb), bomb
