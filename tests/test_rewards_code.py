"""The `code` reward (sandboxed tests, pass rate) and `code_syntax` (the seed's syntax check)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re

import pytest

import grpo.rewards.coding as code_module
from grpo.rewards.coding import Code, code, code_syntax, extract_code, outputs_match, parse_tests, value_check
from grpo.rewards.sandbox import SandboxLayers, SandboxResult, SandboxUnavailable, probe_sandbox

LAYERS = probe_sandbox()
needs_sandbox = pytest.mark.skipif(not LAYERS.isolated, reason=f"no sandbox layers here: {LAYERS.describe()}")
FAST = Code(timeout_s=1.5)


def fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{source}\n```\n"


SUM_TESTS = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]
ADD_ASSERTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


@needs_sandbox
def test_stdin_stdout_pass_rates():
    completions = [
        fenced("a, b = map(int, input().split())\nprint(a + b)"),  # both pass
        fenced("a, b = map(int, input().split())\nprint(a - b)"),  # -1 and 14: both fail
        fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"),  # first passes: 1/2
        fenced("a, b = map(int, input().split()\nprint(a + b)"),  # syntax error: 0.0, nothing launched
        "I think the answer is 5.",  # no code block: 0.0
        fenced("while True:\n    pass"),  # timeout on both: 0.0
        fenced("import os\nos._exit(0)"),  # exits before printing: 0.0
    ]
    assert FAST(completions, test_cases=[SUM_TESTS] * len(completions)) == [1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]


@needs_sandbox
def test_binary_is_all_or_nothing():
    partial = fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)")
    right = fenced("print(sum(map(int, input().split())))")
    assert Code(binary=True)([partial, right], test_cases=[SUM_TESTS, SUM_TESTS]) == [0.0, 1.0]


@needs_sandbox
def test_assert_tests_and_their_reward_hacks():
    completions = [
        fenced("def add(a, b):\n    return a + b"),  # 3/3
        fenced("def add(a, b):\n    return a * b"),  # 6 != 5, -1 != 0, 0 == 0: 1/3
        fenced("import os\nos._exit(0)"),  # exits before the asserts run: 0
        fenced("exit(0)\ndef add(a, b):\n    return a + b"),  # same through the exit() builtin: 0
        # Always-equal object with a lying repr: compared outside the sandbox, it is not an int, so 0.
        fenced("class Liar:\n    def __eq__(self, other):\n        return True\n    def __repr__(self):\n"
               "        return '5'\ndef add(a, b):\n    return Liar()"),
        fenced("import builtins\nbuiltins.repr = lambda v: '5'\ndef add(a, b):\n    return str(a + b)"),  # '5' != 5
    ]
    assert FAST(completions, test_cases=[ADD_ASSERTS] * len(completions)) == [1.0, pytest.approx(1 / 3), 0.0, 0.0,
                                                                              0.0, 0.0]


@needs_sandbox
def test_asserts_without_a_literal_side_run_as_written():
    tests = ["assert add(1, 2) in (3, 4)", "assert abs(add(0.1, 0.2) - 0.3) < 1e-9", "assert add(1, 1) > 5"]
    # The first two hold for a + b, the third does not: 2/3. An early exit scores 0 on the nonce check.
    completions = [fenced("def add(a, b):\n    return a + b"), fenced("import sys\nsys.exit(0)")]
    assert FAST(completions, test_cases=[tests, tests]) == [pytest.approx(2 / 3), 0.0]


@needs_sandbox
def test_collections_and_floats_round_trip_through_the_serializer():
    tests = ["assert f() == [1, (2,), {'a': {3}}, None, True, 1.5, b'x', 2j]", "assert g() == set()"]
    program = "def f():\n    return [1, (2,), {'a': {3}}, None, True, 1.5, b'x', 2j]\ndef g():\n    return set()"
    assert FAST([fenced(program)], test_cases=[tests]) == [1.0]


def test_rows_without_tests_score_none_and_launch_nothing(monkeypatch):
    monkeypatch.setattr(code_module, "run_sandboxed", lambda *a, **k: pytest.fail("launched a sandbox"))
    completions = [fenced("print(1)")] * 4
    other_language = json.dumps({"language": "cpp", "test_cases": SUM_TESTS})
    assert code(completions, test_cases=[None, [], other_language, "[]"]) == [None, None, None, None]


def test_expected_outputs_never_enter_the_sandbox(monkeypatch):
    seen = []

    def fake_run(program, stdin, **settings):
        seen.append(program + stdin)
        return SandboxResult("ok", "7\n", "", 0, 0.01)

    monkeypatch.setattr(code_module, "run_sandboxed", fake_run)
    tests = [{"input": "3 4\n", "output": "expected-output-token"}, "assert add(1, 2) == 987654321"]
    assert Code(layers=LAYERS, allow_unsandboxed=True)([fenced("print(7)")], test_cases=[tests]) == [0.0]
    assert len(seen) == 2 and not any("expected-output-token" in s or "987654321" in s for s in seen)


@needs_sandbox
def test_sandbox_failure_scores_none_not_zero():
    broken = Code(layers=dataclasses.replace(LAYERS, interpreter="/nonexistent/python3"))
    assert broken([fenced("print(5)"), "no code"], test_cases=[SUM_TESTS, SUM_TESTS]) == [None, 0.0]


def test_fails_closed_without_isolation():
    bare = SandboxLayers(userns=False, uid_drop=False, seccomp=False, interpreter=LAYERS.interpreter)
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed"):
        Code(layers=bare)([fenced("print(5)")], test_cases=[SUM_TESTS])
    # Nothing to run (no code block) needs no sandbox, so it does not raise.
    assert Code(layers=bare)(["no code"], test_cases=[SUM_TESTS]) == [0.0]


@needs_sandbox
def test_column_setting_and_open_r1_verification_info():
    info = json.dumps({"language": "python", "test_cases": [dict(t, type="stdin_stdout") for t in SUM_TESTS]})
    reward = code.configure(column="verification_info", timeout_s=2.0)
    conversational = [[{"role": "assistant", "content": fenced("print(sum(map(int, input().split())))")}]]
    assert reward(conversational, verification_info=[info]) == [1.0]
    assert reward.column_requirements == (("verification_info",),)
    with pytest.raises(KeyError, match="'verification_info'.*Code\\(column=...\\)"):
        reward(conversational, test_cases=[info])


def test_trl_shape():
    assert code.__name__ == "code" and Code(binary=True).settings()["binary"] is True
    assert code.column_requirements == (("test_cases", "verification_info"),)  # (open-r1's column, when no test_cases)
    assert Code(column="tests").column_requirements == (("tests",),)


def test_extract_code_takes_the_last_block():
    text = "<code>x = 1</code> then\n```python\ny = 2\n```\nand ```py\n    z = 3\n```"
    assert extract_code(text) == "z = 3"  # last block, dedented
    assert extract_code("```python\na = 1\n```\n<code>b = 2</code>") == "b = 2"
    assert extract_code("```python\nunfinished = (") is None  # truncated completion: no closed block
    assert extract_code("```python\n   \n```") is None
    assert extract_code("```javascript\nlet a = 1\n```") is None


def test_outputs_match_needs_every_line():
    assert outputs_match("5  \n6\n\n", "5\n6")
    assert outputs_match("a\r\nb\r\n", "a\nb\n")
    assert not outputs_match("5\n", "5\n6\n")  # open-r1's zip would pass this
    assert not outputs_match("5\n6\n", "5\n")
    assert not outputs_match(" 5\n", "5\n")


def test_value_check_finds_the_literal_side():
    assert value_check("assert add(2, 3) == 5") == ("add(2, 3)", 5)
    assert value_check("assert [1, 2] == f(x)") == ("f(x)", [1, 2])
    assert value_check("assert f(1) == g(2)") is None
    assert value_check("assert f(1) != 2") is None
    assert value_check("assert f(1) == 2, 'message'") == ("f(1)", 2)
    with pytest.raises(ValueError, match="not valid Python"):
        value_check("assert f(1 == 2")


def test_parse_tests_forms_and_errors():
    assert parse_tests(["assert f() == 1"], "test_list", 0) == [code_module.AssertTest("assert f() == 1")]
    assert parse_tests('[{"input": 1, "output": 2}]', "c", 0) == [code_module.StdioTest("1", "2")]
    with pytest.raises(ValueError, match="column 'c', row 3.*neither an assert"):
        parse_tests([{"stdin": "1"}], "c", 3)
    with pytest.raises(ValueError, match="not JSON"):
        parse_tests("assert f() == 1", "c", 0)


def seed_code_reward_func(completions, **kwargs):
    """Tutorial 000's `code_reward_func`, verbatim except for names: the oracle for `code_syntax`."""
    rewards = []
    for completion in completions:
        try:
            match = re.search(r"<code>([\s\S]+?)<\/code>", completion)
            if match is None:
                rewards.append(0.0)
                continue
            code = match.group(1).strip()
            if re.search(r"\b(import|exec|eval|open|os|sys|subprocess)\b", code):
                rewards.append(0.0)
                continue
            try:
                ast.parse(code)
            except SyntaxError:
                rewards.append(0.3)
                continue
            rewards.append(1.0)
        except Exception:
            rewards.append(0.0)
    return rewards


def test_code_syntax_matches_the_seed_except_for_the_blacklist():
    completions = [
        "<code>print('hi')</code>",  # valid: 1.0
        "<code>def f(:\n    pass</code>", # syntax error: 0.3
        "no code at all",  # 0.0
        "<code>x = [1, 2</code>",  # unclosed bracket: 0.3
        "<code>import os\nprint(os.getcwd())</code>",  # seed 0.0 (blacklist), here 1.0: it parses
    ]
    expected = [1.0, 0.3, 0.0, 0.3, 1.0]
    assert code_syntax(completions) == expected
    assert seed_code_reward_func(completions) == expected[:4] + [0.0]
    assert code_syntax([fenced("x = 1")]) == [1.0]  # fenced blocks count too
