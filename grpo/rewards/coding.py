"""Code rewards: `code` runs the completion's program against the sample's tests in the local sandbox; `code_syntax`
is the seed's syntax-only check (tutorial 000, `code_reward_func`).

`code` reads the test column (`test_cases` by default, else open-r1's `verification_info`; `Code(column=...)` picks
another) in any of these forms:
  * stdin/stdout pairs: `[{"input": "2 3\\n", "output": "5\\n"}, ...]` (open-r1 `verification_info["test_cases"]`);
  * assert statements: `["assert add(2, 3) == 5", ...]` (MBPP `test_list`);
  * open-r1's wrapper `{"language": "python", "test_cases": [...]}`, or any of these as a JSON string.
Each test is one sandboxed run (`sandbox.run_sandboxed`); the reward is the pass rate (open-r1 `code`), or with
`binary=True` 1.0 only when every test passes (open-r1 `binary_code`). A row without tests, or in another language,
scores None ("does not apply"); a row whose runs hit a sandbox failure scores None too, so infrastructure trouble
is never trained on as a wrong answer (reliability.md 1.5).

Judging happens here, never inside the sandbox (reliability.md 1.5):
  * stdin/stdout: the expected output never enters the sandbox; outputs match line by line, ignoring trailing
    whitespace and trailing blank lines. Every line must be there (open-r1 zips the lines, so missing ones pass).
  * `assert CALL == LITERAL`: the sandbox prints the value of CALL, serialized only for exact builtin types, after
    a random nonce; it is parsed back with `ast.literal_eval` and compared here. An object whose `__eq__` is always
    True, or whose `__repr__` lies, fails. Other asserts run as written, followed by printing the nonce.
  * Either way the run must exit 0 and print the nonce line, so `exit(0)` or `os._exit(0)` before the tests fails.
  The nonce stops accidents and shallow hacks, not a program that digs the harness out of its own memory or
  /proc/self/cmdline: for adversarial robustness prefer stdin/stdout tests.
"""

import ast
import concurrent.futures
import dataclasses
import json
import logging
import re
import secrets
import textwrap
from collections.abc import Callable
from typing import Any, ClassVar

from .base import ConfigurableReward
from .sandbox import (
    SandboxLayers,
    SandboxResult,
    SandboxUnavailable,
    probe_sandbox,
    run_sandboxed,
    unavailable_message,
)
from .text import completion_texts

logger = logging.getLogger(__name__)
OPEN_R1_COLUMN = "verification_info"  # open-r1's test column: {"language": ..., "test_cases": [...]}

_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_CODE_TAG = re.compile(r"<code>(.*?)</code>", re.DOTALL)
# Defined before the model's code, with builtins bound as defaults, so rebinding `repr` or `type` later changes
# nothing; only exact builtin types serialize, so subclasses and custom objects cannot pass as a literal.
_SERIALIZER = '''
def _grpo_literal(v, _type=type, _repr=repr, _plain=(int, float, complex, str, bytes, bool, type(None))):
    t = _type(v)
    for p in _plain:
        if t is p:
            return _repr(v)
    if t is list or t is tuple:
        body = ", ".join([_grpo_literal(x) for x in v])
        return "[" + body + "]" if t is list else "(" + body + ("," if len(v) == 1 else "") + ")"
    if t is set:
        return "{" + ", ".join([_grpo_literal(x) for x in v]) + "}" if v else "set()"
    if t is dict:
        return "{" + ", ".join([_grpo_literal(k) + ": " + _grpo_literal(x) for k, x in v.items()]) + "}"
    raise TypeError("a " + t.__name__ + " cannot be compared outside the sandbox")
'''


@dataclasses.dataclass(frozen=True)
class StdioTest:
    input: str
    output: str


@dataclasses.dataclass(frozen=True)
class AssertTest:
    statement: str


@dataclasses.dataclass(frozen=True)
class _Run:
    """One sandbox launch: the program, its stdin, and the judge of its result."""

    row: int
    program: str
    stdin: str
    passed: Callable[[SandboxResult], bool]


def extract_code(text: str) -> str | None:
    """The last ```python (or ```py) fenced block or `<code>...</code>` element, dedented; None if none or blank."""
    matches = [m for pattern in (_FENCE, _CODE_TAG) for m in pattern.finditer(text)]
    if not matches:
        return None
    body = textwrap.dedent(max(matches, key=lambda m: m.end()).group(1)).strip()
    return body or None


def parses(source: str) -> bool:
    """Whether `source` is valid Python. `ast.parse` only parses; nothing is executed."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: null bytes (Python < 3.11.4)
        return False
    return True


def parse_tests(value: Any, column: str, row: int) -> list[StdioTest | AssertTest] | None:
    """A row's tests from the column value (forms in the module docstring); None when the row has none."""
    where = f"column '{column}', row {row}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"code reward: {where} is a string but not JSON ({exc})") from exc
    if isinstance(value, dict):
        if "test_cases" not in value:
            raise ValueError(f"code reward: {where} is a dict without 'test_cases' (keys: {sorted(value)})")
        if str(value.get("language", "python")).lower() != "python":
            return None
        value = value["test_cases"]
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"code reward: {where} must be a list of tests, got {type(value).__name__}")
    tests: list[StdioTest | AssertTest] = []
    for item in value:
        if isinstance(item, str):
            tests.append(AssertTest(item))
        elif isinstance(item, dict) and "input" in item and "output" in item:
            tests.append(StdioTest(str(item["input"]), str(item["output"])))
        else:
            raise ValueError(f"code reward: {where} has a test that is neither an assert string nor a dict with "
                             f"'input' and 'output': {item!r:.200}")
    return tests or None


def outputs_match(actual: str, expected: str) -> bool:
    """Same lines, ignoring trailing whitespace on each line, trailing blank lines and \\r\\n versus \\n."""
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


def value_check(statement: str) -> tuple[str, Any] | None:
    """(source of the computed side, expected literal) for `assert X == LITERAL` (either side); None otherwise."""
    try:
        tree = ast.parse(statement)
    except SyntaxError as exc:
        raise ValueError(f"code reward: test {statement!r:.200} is not valid Python ({exc.msg})") from exc
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    for computed, literal in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
        try:
            return ast.unparse(computed), ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return None


def _nonce_line(stdout: str, nonce: str) -> str | None:
    """The rest of the first line that starts with the nonce, or None."""
    for line in stdout.split("\n"):
        if line.startswith(nonce):
            return line[len(nonce):]
    return None


def _value_passed(result: SandboxResult, nonce: str, expected: Any) -> bool:
    emitted = _nonce_line(result.stdout, nonce)
    if result.status != "ok" or emitted is None:
        return False
    try:
        return ast.literal_eval(emitted.strip()) == expected
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _runs_for(row: int, program: str, tests: list[StdioTest | AssertTest]) -> list[_Run]:
    """One run per test: stdin/stdout tests feed input; assert tests append the assert and a nonce print."""
    runs = []
    for test in tests:
        nonce = "grpo-" + secrets.token_hex(16)
        if isinstance(test, StdioTest):
            runs.append(_Run(row, program, test.input,
                             lambda r, want=test.output: r.status == "ok" and outputs_match(r.stdout, want)))
            continue
        checked = value_check(test.statement)
        if checked is None:
            source = f"{program}\n\n{test.statement}\nprint('\\n' + {nonce!r})\n"
            runs.append(_Run(row, source, "", lambda r, n=nonce: r.status == "ok" and _nonce_line(r.stdout, n) == ""))
        else:
            computed, expected = checked
            source = f"{_SERIALIZER}\n{program}\n\nprint('\\n' + {nonce!r} + _grpo_literal(({computed})))\n"
            runs.append(_Run(row, source, "", lambda r, n=nonce, e=expected: _value_passed(r, n, e)))
    return runs


@dataclasses.dataclass(frozen=True)
class Code(ConfigurableReward):
    """Pass rate of the completion's last Python code block on the row's tests, run in the local sandbox.

    Settings:
        column: dataset column holding the tests (forms in the module docstring).
        binary: 1.0 only when every test passes, else 0.0 (open-r1 `binary_code`).
        timeout_s, memory_mb, max_output_bytes: per-run limits (`run_sandboxed`); the output cap must exceed the
            longest expected output.
        max_workers: sandboxes run at once. Timeouts are wall time, so more workers than cores slows every program.
        allow_unsandboxed: run even where `probe_sandbox()` finds no isolation (fail closed otherwise).
        layers: force a layer set instead of probing (tests; unusual machines).
    Rows without a code block or with a syntax error score 0.0 without launching anything.
    """

    name: ClassVar[str] = "code"
    column: str = "test_cases"
    binary: bool = False
    timeout_s: float = 3.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20
    max_workers: int = 2
    allow_unsandboxed: bool = False
    layers: SandboxLayers | None = None

    @property
    def column_requirements(self) -> tuple[tuple[str, ...], ...]:
        return ((self.column, OPEN_R1_COLUMN) if self.column == "test_cases" else (self.column,),)

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        """(B*G,) completions and the test column in, (B*G,) rewards out (None: no tests, or the sandbox failed)."""
        # the default column, else open-r1's (its `code` and `binary_code` read verification_info)
        column = OPEN_R1_COLUMN if self.column == "test_cases" and self.column not in kwargs else self.column
        if column not in kwargs:
            raise KeyError(f"code reward: no dataset column '{self.column}' (got: {', '.join(sorted(kwargs))}); "
                           "set Code(column=...) to the column holding the tests")
        texts = completion_texts(completions)
        rewards: list[float | None] = [None] * len(texts)
        runs: list[_Run] = []
        for row, (text, value) in enumerate(zip(texts, kwargs[column], strict=True)):
            tests = parse_tests(value, column, row)
            program = extract_code(text)
            if tests is None:
                continue
            if program is None or not parses(program):
                rewards[row] = 0.0
                continue
            runs.extend(_runs_for(row, program, tests))
        results = self._run_all(runs)
        self._score(rewards, runs, results)
        return rewards

    def _run_all(self, runs: list[_Run]) -> list[SandboxResult]:
        if not runs:
            return []
        layers = self.layers or probe_sandbox()
        if not (layers.isolated or self.allow_unsandboxed):
            raise SandboxUnavailable(unavailable_message(layers))

        def launch(run: _Run) -> SandboxResult:
            return run_sandboxed(run.program, run.stdin, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                 max_output_bytes=self.max_output_bytes, layers=layers,
                                 allow_unsandboxed=self.allow_unsandboxed)

        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            return list(pool.map(launch, runs))

    def _score(self, rewards: list[float | None], runs: list[_Run], results: list[SandboxResult]) -> None:
        """Fill `rewards` in place from the runs of each row: pass rate, all-or-nothing, or None on infra errors."""
        per_row: dict[int, list[bool | None]] = {}
        for run, result in zip(runs, results):
            per_row.setdefault(run.row, []).append(None if result.status == "infra_error" else run.passed(result))
        broken = [row for row, passed in per_row.items() if None in passed]
        if broken:
            details = {r.detail for r in results if r.status == "infra_error"}
            logger.warning("code reward: the sandbox failed on %d of %d rows (%s); they score None",
                           len(broken), len(per_row), "; ".join(sorted(details))[:500])
        for row, passed in per_row.items():
            if row in broken:
                continue
            rate = sum(passed) / len(passed)
            rewards[row] = float(rate == 1.0) if self.binary else rate


code = Code()


def code_syntax(completions: list, **kwargs) -> list[float]:
    """The seed's check: 1.0 if the code block parses, 0.3 if it does not, 0.0 without a block. (B*G,) -> (B*G,).

    Nothing runs: `ast.parse` only parses. Two departures from the seed: a fenced ```python block counts as well as
    `<code>...</code>` (the last block wins), and the seed's 0.0 for any code mentioning import/exec/eval/open/os/
    sys/subprocess is dropped: that blacklist is bypassed trivially (reliability.md 1.2) and guards nothing here.
    """
    scores = []
    for text in completion_texts(completions):
        program = extract_code(text)
        scores.append(0.0 if program is None else 1.0 if parses(program) else 0.3)
    return scores
