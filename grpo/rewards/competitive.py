"""open-r1's `cf_code`: a Codeforces submission judged on the row's tests in grpo's local sandbox, not on Piston.

The data is open-r1's `open-r1/codeforces` (verifiable-prompts) layout, one problem per row: `official_tests`
(`[{"input", "output"}]`), `generated_checker` (a Python checker or null), `time_limit` (seconds), `memory_limit`
(MB), `input_mode` ("stdio", or "file": input.txt in, output.txt out) and `language` of the submission. The judging
is that of open-r1's Piston package (guipenedo/piston, packages/codeforces/1.0.0/run):

  * the program runs on each test's input within the time and memory limits; a non-zero exit, a timeout or
    running out of memory fails the test;
  * with a checker, `python3 checker.py INPUT CORRECT_OUTPUT SOLUTION_OUTPUT` decides (it prints 1 or 100 to pass),
    run in the sandbox too; without one, both outputs are compared after whole-word yes/no are upper-cased and every
    run of whitespace is one space (empty lines of either dropped first);
  * score (`scoring_mode`): weighted_sum = pass_fail + 0.1 x passed / tests (open-r1's default), partial = passed /
    tests, pass_fail = 1 only if every test passes; -1.0 without a code block, None for a row without tests.

The row's `language` picks the code block (```python or ```cpp). Python runs one sandboxed run per test; C++ is
compiled and run on every test inside one sandboxed run (g++ -O2 -std=c++17; a compile error scores -0.1, open-r1's
no_compile_reward). Other languages score None. A row whose runs hit a sandbox failure scores None, as the `code`
reward does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
from typing import Any, ClassVar

from .base import ConfigurableReward
from .sandbox import SandboxResult, run_sandboxed
from .text import completion_texts

NO_SUBMISSION = -1.0  # open-r1's no_submission_reward
NO_COMPILE = -0.1  # open-r1's no_compile_reward
COMPILE_S = 60.0  # g++'s deadline, inside the sandbox
_LANGUAGES = {"python": "python", "python3": "python", "cpp": "cpp", "c++": "cpp", "c++17": "cpp"}

# Run inside the sandbox: the stdin is a JSON object of the files to write into the working directory (a private
# tmpfs); then the program named by `main` runs as __main__ with `argv`, its stdin the file `stdin` (if any); with
# `output_file`, that file's content is the run's output. Its exec of the submission (or checker) happens in the
# sandboxed interpreter only: the trainer's process never executes this text, it only hands it to `run_sandboxed`.
_HARNESS = r'''
import io, json, os, sys
spec = json.loads(sys.stdin.read())
for name, text in spec["files"].items():
    with open(name, "w") as f:
        f.write(text)
sys.argv = spec["argv"]
sys.stdin = open(spec["stdin"]) if spec["stdin"] else io.StringIO("")
output_file, real = spec["output_file"], sys.stdout
if output_file:  # (file mode: what the program prints is discarded, as Piston's run script does)
    sys.stdout = open(os.devnull, "w")
source = spec["files"][spec["main"]]
del spec
try:
    exec(compile(source, sys.argv[0], "exec"), {"__name__": "__main__"})
except SystemExit as stop:
    if stop.code not in (None, 0):
        raise
if output_file:
    sys.stdout = real
    if os.path.exists(output_file):
        real.write(open(output_file).read())
'''


# Run inside the sandbox for a C++ submission: compile it once (g++ -O2 -std=c++17, as Piston's package does), then
# run it on each test's input with the time limit and an address-space limit, collecting (exited 0, output).
_CPP_HARNESS = r'''
import json, os, resource, subprocess, sys
spec = json.loads(sys.stdin.read())
with open("main.cpp", "w") as f:
    f.write(spec["program"])
try:
    built = subprocess.run(["g++", "-DONLINE_JUDGE", "-O2", "-std=c++17", "-pipe", "main.cpp", "-o", "main"],
                           capture_output=True, timeout=spec["compile_s"])
    compiled = built.returncode == 0
except subprocess.TimeoutExpired:
    compiled = False
memory = spec["memory_mb"] << 20


def limit():
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


results = []
for text in spec["inputs"] if compiled else []:
    if spec["file_mode"]:
        with open("input.txt", "w") as f:
            f.write(text)
        if os.path.exists("output.txt"):
            os.remove("output.txt")
    try:
        run = subprocess.run(["./main"], input="" if spec["file_mode"] else text, capture_output=True, text=True,
                             timeout=spec["time_s"], preexec_fn=limit, errors="replace")
        output = run.stdout
        if spec["file_mode"]:
            output = open("output.txt", errors="replace").read() if os.path.exists("output.txt") else ""
        results.append([run.returncode == 0, output])
    except subprocess.TimeoutExpired:
        results.append([False, ""])
print(json.dumps({"compiled": compiled, "results": results}))
'''


def extract_code(text: str, language: str) -> str:
    """The last ```<language> block, as open-r1's extract_code ("" without one)."""
    blocks = re.findall(rf"```{re.escape(language)}\n(.*?)```", text, re.DOTALL)
    return blocks[-1] if blocks else ""


def normalize(output: str) -> str:
    """open-r1's Piston `normalize_output`: YES/NO upper-cased as whole words, whitespace runs made one space."""
    lines = [line for line in output.replace("\r", "").split("\n") if line != ""]
    text = re.sub(r"\b(yes)\b", "YES", " ".join(lines), flags=re.IGNORECASE)
    text = re.sub(r"\b(no)\b", "NO", text, flags=re.IGNORECASE)
    return " ".join(text.split())


def run_harness(harness: str, stdin: str, timeout_s: float, memory_mb: int, allow_unsandboxed: bool,
                **limits) -> SandboxResult:
    """A judging harness run in the sandbox (fail closed: `SandboxUnavailable` without one, unless allowed)."""
    limits = {"max_output_bytes": 1 << 24, **limits}
    return run_sandboxed(harness, stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                         allow_unsandboxed=allow_unsandboxed, **limits)


def rows_of(kwargs: dict, n: int) -> list[dict]:
    """The dataset's columns as one mapping per completion (the columns that hold one value per completion)."""
    return [{key: values[i] for key, values in kwargs.items() if isinstance(values, list) and len(values) == n}
            for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Codeforces(ConfigurableReward):
    """open-r1's `cf_code` (see the module docstring). Settings: scoring_mode, max_workers, allow_unsandboxed."""

    name: ClassVar[str] = "cf_code"
    column_requirements: ClassVar[tuple[tuple[str, ...], ...]] = (("official_tests",),)
    scoring_mode: str = "weighted_sum"
    max_workers: int = 2
    allow_unsandboxed: bool = False

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        if self.scoring_mode not in ("weighted_sum", "partial", "pass_fail"):
            raise ValueError(f"cf_code: scoring_mode {self.scoring_mode!r} is not weighted_sum, partial or pass_fail")
        texts = completion_texts(completions)
        problems = rows_of(kwargs, len(texts))
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            return list(pool.map(self._score, texts, problems))

    def _score(self, text: str, problem: dict[str, Any]) -> float | None:
        tests = problem.get("official_tests")
        if isinstance(tests, str):
            tests = json.loads(tests)
        if not tests:
            return None
        language = _LANGUAGES.get(str(problem.get("language") or "python").lower())
        if language is None:
            return None  # (a language not built here)
        program = extract_code(text, language)
        if not program:
            return NO_SUBMISSION
        ran = (self._run_cpp(program, problem, tests) if language == "cpp" else
               [self._run_python(program, problem, test["input"]) for test in tests])
        if ran == "compile_error":
            return NO_COMPILE
        if ran is None or None in ran:
            return None  # (the sandbox failed: unknown, not wrong)
        passed = []
        for (ok, output), test in zip(ran, tests):
            verdict = ok and self._check(problem, test["input"], test["output"], output)
            if verdict is None:
                return None
            passed.append(bool(verdict))
        rate = sum(passed) / len(tests)
        full = float(all(passed))
        return {"pass_fail": full, "partial": rate, "weighted_sum": full + 0.1 * rate}[self.scoring_mode]

    def _sandbox(self, program: str, stdin: str, timeout_s: float, memory_mb: int, **limits) -> SandboxResult:
        return run_harness(program, stdin, timeout_s, memory_mb, self.allow_unsandboxed, **limits)

    def _run(self, files: dict[str, str], main: str, argv: list[str], stdin: str | None, timeout_s: float,
             memory_mb: int, output_file: str | None = None) -> SandboxResult:
        spec = json.dumps({"files": files, "main": main, "argv": argv, "stdin": stdin, "output_file": output_file})
        return self._sandbox(_HARNESS, spec, timeout_s, memory_mb)

    def _run_python(self, program: str, problem: dict, test_input: str) -> tuple[bool, str] | None:
        """(exited 0 within the limits, its output) of one test; None when the sandbox failed."""
        limit = float(problem.get("time_limit") or 2.0)
        memory = int(float(problem.get("memory_limit") or 256)) + 64  # (the interpreter's own share)
        file_mode = problem.get("input_mode") == "file"
        files = {"main.py": program, "input.txt": test_input.replace("\r", "")}
        ran = self._run(files, "main.py", ["main.py"], None if file_mode else "input.txt", limit, memory,
                        "output.txt" if file_mode else None)
        return None if ran.status == "infra_error" else (ran.status == "ok", ran.stdout)

    def _run_cpp(self, program: str, problem: dict, tests: list[dict]) -> list | str | None:
        """Compiled once and run on every test in one sandbox: [(ok, output)] per test, "compile_error", or None
        when the sandbox failed."""
        limit = float(problem.get("time_limit") or 2.0)
        spec = json.dumps({"program": program, "inputs": [t["input"].replace("\r", "") for t in tests],
                           "time_s": limit, "memory_mb": int(float(problem.get("memory_limit") or 256)),
                           "file_mode": problem.get("input_mode") == "file", "compile_s": COMPILE_S})
        ran = self._sandbox(_CPP_HARNESS, spec, COMPILE_S + len(tests) * (limit + 1.0), 2048, max_processes=64)
        if ran.status != "ok":
            return None
        report = json.loads(ran.stdout)
        return [tuple(r) for r in report["results"]] if report["compiled"] else "compile_error"

    def _check(self, problem: dict, test_input: str, expected: str, output: str) -> bool | None:
        """Piston's verdict on one output: the row's checker's, or the normalized comparison; None: sandbox failed."""
        checker = problem.get("generated_checker")
        if not checker:
            return normalize(output) == normalize(expected)
        clean = "\n".join(line for line in expected.replace("\r", "").split("\n") if line != "")
        judged = self._run({"checker.py": checker, "input.txt": test_input, "correct_output.txt": clean,
                            "solution_output.txt": output}, "checker.py",
                           ["checker.py", "input.txt", "correct_output.txt", "solution_output.txt"], None, 10.0, 512)
        if judged.status == "infra_error":
            return None
        return judged.stdout.strip() in ("1", "100")


cf_code = Codeforces()
