"""RewardRunner (TRL protocol, weights, None, every failure named) and the registry that resolves config specs."""

import asyncio
import math
import re
import sys
import textwrap

import pytest

from grpo.rewards import r1_format
from grpo.rewards import (
    ALIASES,
    BUILTINS,
    Countdown,
    RewardError,
    RewardRunner,
    column_requirements,
    countdown,
    math_accuracy,
    resolve_reward,
    resolve_step_reward,
    think_format,
)

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["aaaa", "bb", "cccccc"]
IDS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]


def run(funcs, columns=None, **settings):
    runner = RewardRunner(funcs, **settings)
    return runner(PROMPTS, COMPLETIONS, IDS, columns or {})


def constant(values, name="f"):
    def reward(completions, **kwargs):
        return list(values)

    reward.__name__ = name
    return name, reward


# ---------------------------------------------------------------------------------------------- TRL compatibility


def reward_len(completions, **kwargs):
    """The reward function of TRL's documentation, unchanged."""
    return [-abs(20 - len(completion)) for completion in completions]


def open_r1_accuracy(completions, solution, **kwargs):
    """open-r1 style: conversational completions, gold in `solution`."""
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if content.strip() == sol else 0.0 for content, sol in zip(contents, solution)]


def test_trl_and_open_r1_functions_run_unchanged():
    out = run([("reward_len", reward_len)])
    assert out.total == [-16, -18, -14]  # |20 - 4|, |20 - 2|, |20 - 6|
    conversational = [[{"role": "assistant", "content": text}] for text in (" 7", "8", "7 ")]
    runner = RewardRunner([resolve_reward(open_r1_accuracy), resolve_reward("format")])
    out = runner(PROMPTS, conversational, IDS, {"solution": ["7", "7", "7"]})
    assert out.per_func == {"open_r1_accuracy": [1.0, 0.0, 1.0], "r1_format": [0.0, 0.0, 0.0]}


def test_weights_and_none_follow_trl_nansum():
    # Row 0: 1.0 * 1 + 0.1 * 1 + 0.05 * 0.5 = 1.125. Row 1: 1.0 * 0 + (None skipped) + 0.05 * 1 = 0.05.
    # Row 2: (None skipped) + 0.1 * 1 + 0.05 * 0 = 0.1.
    out = run(
        [constant([1.0, 0.0, None], "accuracy"), constant([1, None, 1], "format"), constant([0.5, 1, 0], "tags")],
        weights=[1.0, 0.1, 0.05],
    )
    assert out.total == pytest.approx([1.125, 0.05, 0.1])
    assert out.per_func["format"] == [1.0, None, 1.0]
    assert out.errors == {"accuracy": 0, "format": 0, "tags": 0}


def test_every_function_none_names_the_row():
    with pytest.raises(RewardError, match=r"returned None for row 1 \(completion 'bb'\)"):
        run([constant([1.0, None, 2.0], "a"), constant([None, None, 1.0], "b")])


@pytest.mark.parametrize(
    "result, message",
    [
        ([1.0, 2.0], "reward function 'f' returned 2 rewards for 3 completions"),
        ("1.0", "reward function 'f' returned str"),
        (["1.0", 1.0, 1.0], r"reward function 'f' returned '1.0' \(str\) for row 0"),
        ([1.0, {"x": 1}, 1.0], "for row 1; a reward must be a number"),
        (5.0, "reward function 'f' returned float"),
    ],
)
def test_protocol_violations_name_the_function(result, message):
    with pytest.raises(RewardError, match=message):
        run([constant(result) if isinstance(result, list) else ("f", lambda completions, **kw: result)])


def test_numpy_scalars_bools_and_big_ints():
    np = pytest.importorskip("numpy")
    out = run([constant([np.float32(0.5), True, np.int64(2)])])
    assert out.total == [0.5, 1.0, 2.0]
    with pytest.raises(RewardError, match="returned inf for row 2"):
        run([constant([0.0, 0.0, 10**400])])  # too big for a float: non-finite, not a crash


def flaky(completions, **kwargs):
    if any("cc" in c for c in completions):
        raise RuntimeError("sandbox connection reset")
    return [1.0] * len(completions)


def test_exception_raises_naming_function_and_row():
    with pytest.raises(RewardError, match=r"'flaky' raised RuntimeError: sandbox connection reset on row 2"):
        run([("flaky", flaky)])


def test_exception_as_counted_zero():
    out = run([("flaky", flaky), constant([1.0, 1.0, 1.0], "other")], on_error="zero")
    assert out.per_func["flaky"] == [1.0, 1.0, 0.0]  # rows 0 and 1 succeed when run on their own
    assert out.total == [2.0, 2.0, 1.0]
    assert out.errors == {"flaky": 1, "other": 0}


def test_transient_batch_failure():
    calls = []

    def once(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 1:
            raise ConnectionError("reset")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="on no single row"):
        run([("once", once)])
    calls.clear()
    out = run([("once", once)], on_error="zero")
    assert out.total == [1.0, 1.0, 1.0] and out.errors == {"once": 1} and calls == [3, 1, 1, 1]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_both_settings(bad):
    funcs = [constant([1.0, bad, 1.0], "f"), constant([0.5, 0.5, 0.5], "g")]
    with pytest.raises(RewardError, match=rf"'f' returned {bad} for row 1"):
        run(funcs)
    out = run(funcs, on_nonfinite="none")
    assert out.per_func["f"] == [1.0, None, 1.0]
    assert out.total == [1.5, 0.5, 1.5]
    assert out.errors == {"f": 1, "g": 0}


def test_async_functions_run_concurrently():
    async def slow(completions, **kwargs):
        await asyncio.sleep(0.2)
        return [1.0] * len(completions)

    async def slower(completions, **kwargs):
        await asyncio.sleep(0.2)
        return [2.0] * len(completions)

    import time

    start = time.perf_counter()
    out = run([("slow", slow), ("slower", slower), ("reward_len", reward_len)])
    assert time.perf_counter() - start < 0.35  # gathered: 0.2 s, not 0.4 s
    assert out.total == [-13.0, -15.0, -11.0]


def test_async_function_that_raises():
    async def broken(completions, **kwargs):
        raise ValueError("no")

    with pytest.raises(RewardError, match="'broken' raised ValueError: no on row 0"):
        run([("broken", broken)])


def test_function_without_kwargs_gets_only_what_it_names():
    def lengths(completion_ids):
        return [float(len(ids)) for ids in completion_ids]

    assert run([("lengths", lengths)], {"extra": [1, 2, 3]}).total == [4.0, 2.0, 6.0]


def test_column_lengths_are_checked():
    with pytest.raises(RewardError, match="'nums' has 2 entries for 3 completions"):
        run([("reward_len", reward_len)], {"nums": [1, 2]})


def test_check_columns_before_training():
    def needs_hint(completions, hint, style="x", **kwargs):
        return [0.0] * len(completions)

    runner = RewardRunner([resolve_reward("countdown"), ("needs_hint", needs_hint), resolve_reward("accuracy")])
    with pytest.raises(RewardError) as error:
        runner.check_columns(["prompt", "answer"])
    assert str(error.value) == (
        "reward function 'countdown' needs column 'target', which the dataset lacks (columns: answer, prompt)\n"
        "reward function 'countdown' needs column 'nums', which the dataset lacks (columns: answer, prompt)\n"
        "reward function 'needs_hint' needs column 'hint', which the dataset lacks (columns: answer, prompt)"
    )
    runner.check_columns(["prompt", "target", "nums", "hint", "solution"])
    assert column_requirements(math_accuracy) == [("solution", "answer")]
    assert column_requirements(open_r1_accuracy) == [("solution",)]


def test_runner_rejects_bad_setup():
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        RewardRunner([("reward_len", reward_len)], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="repeated: reward_len"):
        RewardRunner([("reward_len", reward_len), ("reward_len", reward_len)])
    with pytest.raises(ValueError, match="on_error"):
        RewardRunner([("reward_len", reward_len)], on_error="ignore")


# ------------------------------------------------------------------------------------------------------ registry


def test_resolve_builtins_aliases_and_settings():
    assert resolve_reward("think_format") == ("think_format", think_format)
    assert resolve_reward("format") == ("r1_format", r1_format)  # open-r1's format_reward, exactly
    assert r1_format(["<think>\na\n</think>\n<answer>\n1\n</answer>", "<think>a</think>\n<answer>1</answer>"]) == \
        [1.0, 0.0]
    assert resolve_reward("accuracy") == ("math_accuracy", math_accuracy)
    assert resolve_reward(countdown) == ("countdown", countdown)
    name, func = resolve_reward({"name": "countdown", "exact_use": True, "format_score": 0.1})
    assert name == "countdown" and func == Countdown(exact_use=True, format_score=0.1)
    assert resolve_reward({"name": "repetition_penalty", "ngram_size": 2})[1].ngram_size == 2
    assert set(ALIASES.values()) <= set(BUILTINS)


def test_unknown_names_list_the_builtins():
    with pytest.raises(ValueError, match=re.escape("unknown reward 'acuracy'; built-ins: ")) as error:
        resolve_reward("acuracy")
    assert "countdown" in str(error.value) and "accuracy (= math_accuracy)" in str(error.value)
    with pytest.raises(ValueError, match="no setting 'exact'"):
        resolve_reward({"name": "countdown", "exact": True})
    with pytest.raises(ValueError, match="unknown reward 'think_format'"):
        resolve_step_reward("think_format")


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "countdown", "exact_use": "yes"}, "countdown: setting exact_use must be bool, got 'yes'"),
        ({"name": "cosine_length", "max_len": 1.5}, "cosine_length: setting max_len must be int"),
        ({"name": "math_accuracy", "gold_columns": "answer"}, "gold_columns must be a list of names"),
        ({"name": "soft_overlong", "max_length": 100, "cache_length": 200}, "need 0 < cache_length <= max_length"),
    ],
)
def test_settings_are_validated_at_load_time(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward(spec)


def test_resolve_import_paths_and_factories(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        def short(completions, **kwargs):
            return [1.0 if len(c) < 5 else 0.0 for c in completions]

        def get_length_reward(limit=5):
            def length_reward(completions, **kwargs):
                return [1.0 if len(c) < limit else 0.0 for c in completions]
            return length_reward

        class Steps:
            def __call__(self, completions, **kwargs):
                return [[(len(c), 1.0)] for c in completions]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name, func = resolve_reward("my_rewards:short")
    assert name == "short" and func(["abc", "abcdef"]) == [1.0, 0.0]
    name, func = resolve_reward({"name": "my_rewards:get_length_reward", "limit": 7})
    assert name == "length_reward" and func(["abcdef"]) == [1.0]
    name, func = resolve_step_reward("my_rewards:Steps")
    assert name == "Steps" and func(["ab"]) == [[(2, 1.0)]]
    assert resolve_step_reward("arithmetic_steps")[0] == "arithmetic_steps"
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="cannot import module 'not_a_module_x'"):
        resolve_reward("not_a_module_x:f")
    with pytest.raises(ValueError, match="does not accept the settings"):
        resolve_reward({"name": "my_rewards:get_length_reward", "size": 3})
    sys.modules.pop("my_rewards", None)


# ---- timeouts: a hanging reward costs seconds, not the run ---------------------------------------------------------
def _hangs(completions, **kwargs):
    import time

    time.sleep(30)
    return [1.0] * len(completions)


async def _hangs_async(completions, **kwargs):
    import asyncio

    await asyncio.sleep(30)
    return [1.0] * len(completions)


def _fine(completions, **kwargs):
    return [0.5] * len(completions)


def _raises(completions, **kwargs):
    raise ValueError("always")


@pytest.mark.parametrize("hang", [_hangs, _hangs_async], ids=["sync", "async"])
def test_timeout_raise_names_the_function(hang):
    import time

    runner = RewardRunner([("hangs", hang), ("fine", _fine)], timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"reward function 'hangs' did not return within 0.3 s"):
        runner(["p", "q"], ["a", "b"], [[1], [2]], {})
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("hang", [_hangs, _hangs_async], ids=["sync", "async"])
def test_timeout_zero_scores_the_batch_and_counts(hang):
    runner = RewardRunner([("hangs", hang), ("fine", _fine)], weights=[1.0, 2.0], on_error="zero", timeout_s=0.3)
    out = runner(["p", "q"], ["a", "b"], [[1], [2]], {})
    assert out.per_func["hangs"] == [0.0, 0.0] and out.total == [1.0, 1.0]  # 1*0 + 2*0.5
    assert out.timeouts == {"hangs": 1, "fine": 0}
    assert out.errors["hangs"] == 2  # each row of the call (it was 1 per call: 1 of 64 rows, under the alarm's 10%)


def test_a_reward_timing_out_on_every_call_alarms_as_one_that_raises():
    """reward_errors judges the failed rows' fraction (rollout: errors / rows); a timeout fails every row."""
    from grpo.training.observe.health import HealthMonitor

    fractions = {}
    for name, func in (("hangs", _hangs), ("raises", _raises)):
        runner = RewardRunner([(name, func)], on_error="zero", timeout_s=0.2)
        out = runner(["p"] * 64, ["a"] * 64, [[1]] * 64, {})
        fractions[name] = out.errors[name] / len(out.per_func[name])
    assert fractions == {"hangs": 1.0, "raises": 1.0}
    monitor = HealthMonitor("hangs", None)
    _, alarms = monitor.check({"reward/error_frac/hangs": fractions["hangs"]})
    assert [name for name, _ in alarms] == ["reward_errors"]


def test_timeout_leaves_fast_functions_alone():
    runner = RewardRunner([("fine", _fine)], timeout_s=5.0)
    assert runner(["p"], ["a"], [[1]], {}).per_func["fine"] == [0.5]
