"""open-r1's `ioi_code`: a C++ submission for one IOI subtask, compiled with the problem's graders and judged on the
subtask's tests in grpo's local sandbox, as open-r1's Piston package (guipenedo/piston, packages/cms_ioi) does.

The data is open-r1's `open-r1/ioi` layout, one subtask per row: `id` (the problem), `subtask`, `test_names`,
`grader_files` (`[[path, content], ...]`: `graders/<id>.h`, `graders/grader.cpp` or `stub.cpp`,
`graders/grader_config.json`, and for some problems `checker/checker.cpp` and `graders/manager.cpp`), `time_limit`
(s), `memory_limit` (MB), `task_type`, `score_precision`, `year`. The tests, `{test_name: (input, output)}`, come
from the row's `test_cases` column (a mapping by test name, or a list in `test_names`' order; each test
`[input, output]` or `{"input", "output"}`; open-r1's score_subtask reads the same column), else from the reward's
`tests_dir`: a local copy of the hub's `open-r1/ioi-test-cases` (`<year>/*.parquet` with problem_id, test_name,
test_input, test_output), which open-r1 downloads at run time and grpo, with no network, reads from disk.

The judging (Piston's cms_ioi compile and run scripts):
  * the submission is the last ```cpp block, with open-r1's `add_includes` (bits/stdc++.h, `"<id>.h"`, and
    `using namespace std;` when it names no std::), written as `graders/<id>.cpp`; the checker and the manager
    (if any) and then the graders are compiled with g++ -std=gnu++17 -O2;
  * Batch: the grader runs on each test's input within grader_config.json's time limit (the row's if it has none)
    and address-space limit, stack unlimited; Communication: the manager runs on the input within the time limit,
    talking to num_processes copies of the grader through FIFOs (std_io or fifo_io), its output the verdict;
  * a timeout or a non-zero exit scores the test 0; else the checker's output is its score (`checker/checker
    input.txt correct_output.txt output`), or without a checker the outputs are compared by `diff -b` (1 or 0), or
    with neither a checker nor an expected output (a manager's verdict) the output itself is the score.
The reward is open-r1's `SubtaskResult.score`: the minimum over the subtask's tests, rounded to `score_precision`
(the subtask's points do not scale it), so 1.0 when every test passes, 0.0 when one fails, a checker's partial
score otherwise; 0.0 without a ```cpp block or when it does not compile. Tests run in order and stop at the first
that scores 0 (open-r1's early stop; the minimum is 0 then anyway). Departures: a row without tests or of another
task type (OutputOnly: the submission is an output file, not a program) scores None (open-r1: 0), and so does a
row whose run hit a sandbox failure (open-r1 scores a Piston worker error 0), as grpo's `code` and `cf_code` do.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

from .base import ConfigurableReward
from .competitive import COMPILE_S, extract_code, rows_of, run_harness
from .text import completion_texts

logger = logging.getLogger(__name__)
TASK_TYPES = ("Batch", "Communication")
CHECKER_S = 10.0  # a checker's own deadline, per test

# Run inside the sandbox. stdin: {"files": {path: text}, "config": grader_config.json's keys over the row's,
# "tests": [[input, output]], "compile_s", "checker_s"}. Prints {"compiled": bool, "results": [[score text, feedback]]}
# for the tests run (it stops after the first scoring 0).
_HARNESS = r'''
import json, os, resource, subprocess, sys
spec = json.loads(sys.stdin.read())
for path, text in spec["files"].items():
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
config = spec["config"]
time_s, memory = float(config["time_limit"]), int(config["memory_limit"])


def gxx(args, out):
    try:
        built = subprocess.run(["g++", *args, "-o", out], capture_output=True, timeout=spec["compile_s"])
        return built.returncode == 0
    except subprocess.TimeoutExpired:
        return False


def build():
    """CMS's compile script: checker, manager, then the graders with the submission; the program's name or None."""
    for source, out in (("checker/checker.cpp", "checker/checker"), ("graders/manager.cpp", "graders/manager")):
        if os.path.exists(source) and not gxx(["-x", "c++", "-std=gnu++17", "-O2", source], out):
            return None
    headers = [n for n in sorted(os.listdir("graders")) if n.endswith(".h") and n != "testlib.h"]
    name = headers[0][:-2] if headers else "?"
    sources = [f"graders/{name}.cpp"] + [f"graders/{g}" for g in ("grader.cpp", "stub.cpp")
                                         if os.path.exists(f"graders/{g}")]
    return name if gxx(["-DEVAL", "-std=gnu++17", "-O2", "-pipe", "-s", *sources], f"graders/{name}") else None


def limit():
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))  # (CMS: ulimit -s unlimited, for deep recursion)


def run(command, out):
    """None if the command exited 0 within the time limit, else the feedback."""
    with open("input.txt") as stdin:
        try:
            code = subprocess.run(command, stdin=stdin, stdout=out, stderr=subprocess.DEVNULL, timeout=time_s,
                                  preexec_fn=limit).returncode
        except subprocess.TimeoutExpired:
            return f"Time limit exceeded ({time_s}s)"
    code = 128 - code if code < 0 else code
    if code in (124, 137, 143):
        return f"Time limit exceeded ({time_s}s)"
    return None if code == 0 else f"Runtime error with exit code {code}"


def communicate(program, out):
    """The manager on the input, talking through FIFOs to each user process; None or the feedback."""
    count = int(config.get("task_type_parameters_Communication_num_processes") or 1)
    fifo_io = config.get("task_type_parameters_Communication_user_io") == "fifo_io"
    users, args = [], []
    for i in range(count):
        os.makedirs(f"fifo{i}", exist_ok=True)
        to_manager, from_manager = f"fifo{i}/u{i}_to_m", f"fifo{i}/m_to_u{i}"
        for fifo in (to_manager, from_manager):
            if not os.path.exists(fifo):
                os.mkfifo(fifo)
        args += [to_manager, from_manager]
        index = [str(i)] if count != 1 else []
        # std_io: the shell opens the FIFOs after the fork (opening one blocks until the manager opens its end)
        command = ([program, from_manager, to_manager, *index] if fifo_io else
                   ["sh", "-c", 'i=$1; o=$2; shift 2; exec "$@" <"$i" >"$o" 2>/dev/null', "sh", from_manager,
                    to_manager, program, *index])
        users.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      preexec_fn=limit))
    extra = config.get("task_type_parameters_Communication_manager_args")
    try:
        return run(["graders/manager", *args, *(extra.split() if extra else [])], out)
    finally:
        for user in users:
            user.kill()
            user.wait()


def judge(program, test_input, expected):
    with open("input.txt", "w") as f:
        f.write(test_input)
    with open("output.txt", "w") as out:
        failed = (run([program], out) if config["task_type"] == "Batch" else communicate(program, out))
    if failed:
        return ["0", failed]
    expected = expected.rstrip("\n")  # (CMS's run script holds it in a shell variable, then echoes it)
    if expected:
        with open("correct_output.txt", "w") as f:
            f.write(expected + "\n")
        if os.path.exists("checker/checker"):
            try:
                checked = subprocess.run(["checker/checker", "input.txt", "correct_output.txt", "output.txt"],
                                         capture_output=True, text=True, errors="replace", timeout=spec["checker_s"])
            except subprocess.TimeoutExpired:
                return ["", "checker timed out"]
            return [checked.stdout[:100], checked.stderr[-300:]]
        if config["task_type"] == "Batch":
            same = subprocess.run(["diff", "-bq", "correct_output.txt", "output.txt"], capture_output=True)
            return ["1", "Output is correct (diff)"] if same.returncode == 0 else ["0", "Output isn't correct (diff)"]
    return [open("output.txt", errors="replace").read(100), ""]


def points(text):
    try:
        return float(text)
    except ValueError:
        return 0.0


name = build()
results = []
for test_input, expected in spec["tests"] if name else []:
    results.append(judge("graders/" + config.get("code", name), test_input, expected))
    if points(results[-1][0]) == 0.0:
        break
print(json.dumps({"compiled": name is not None, "results": results}))
'''


def add_includes(code: str, problem_id: str) -> str:
    """open-r1's add_includes: bits/stdc++.h, the problem's header and `using namespace std;` before the code."""
    if not code:
        return code
    header = "#include <bits/stdc++.h>\n"
    if f'#include "{problem_id}.h"' not in code:
        header += f'#include "{problem_id}.h"\n'
    if "using namespace std;" not in code and "std::" not in code:
        header += "\nusing namespace std;\n\n"
    return header + code


def points(text: str) -> float:
    """A test's score as CMS's checker prints it (open-r1's float(); unreadable output scores 0)."""
    try:
        return float(text)
    except ValueError:
        return 0.0


@functools.lru_cache(maxsize=4)
def load_tests(tests_dir: str, year: int, problem_id: str) -> dict[str, tuple[str, str]]:
    """{test_name: (input, output)} of one problem from a local copy of open-r1/ioi-test-cases."""
    import pyarrow.parquet as pq

    folder = Path(tests_dir) / str(year)
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    if not files:
        raise ValueError(f"ioi_code: tests_dir has no {folder}/*.parquet; it must hold open-r1/ioi-test-cases as "
                         "the hub lays it out (huggingface-cli download open-r1/ioi-test-cases --repo-type dataset "
                         "--local-dir DIR)")
    table = pq.read_table(files, columns=["test_name", "test_input", "test_output"],
                          filters=[("problem_id", "==", problem_id)]).to_pydict()
    return {name: (text, out) for name, text, out in zip(table["test_name"], table["test_input"],
                                                         table["test_output"])}


def _pair(case: Any) -> tuple[str, str]:
    return (case["input"], case["output"]) if isinstance(case, dict) else (case[0], case[1])


def _label(row: dict) -> str:
    return f"problem {row.get('id')!r} subtask {row.get('subtask')!r}"


@dataclasses.dataclass(frozen=True)
class IOI(ConfigurableReward):
    """open-r1's `ioi_code` (see the module docstring). Settings: tests_dir, max_workers, allow_unsandboxed."""

    name: ClassVar[str] = "ioi_code"
    column_hint: ClassVar[str] = ("give each row its tests in a test_cases column, or the reward a tests_dir: "
                                  "{name: ioi_code, tests_dir: DIR} (a local copy of open-r1/ioi-test-cases)")
    tests_dir: str | None = None
    max_workers: int = 2
    allow_unsandboxed: bool = False

    @property
    def column_requirements(self) -> tuple[tuple[str, ...], ...]:
        return (("id",), ("test_names",), ("grader_files",), ("year",) if self.tests_dir else ("test_cases",))

    def __call__(self, completions: list, **kwargs) -> list[float | None]:
        """(B*G,) completions and the subtask columns in, (B*G,) rewards out (see the module docstring)."""
        texts = completion_texts(completions)
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            return list(pool.map(self._score, texts, rows_of(kwargs, len(texts))))

    def _score(self, text: str, row: dict[str, Any]) -> float | None:
        names = list(row.get("test_names") or [])
        files = self._files(row)
        config = self._config(row, files)
        if not names or config["task_type"] not in TASK_TYPES:
            return None
        tests = self._tests(row, names)
        code = add_includes(extract_code(text, "cpp"), str(row["id"]))
        if not code:
            return 0.0
        files[f"graders/{str(row['id']).lower()}.cpp"] = code
        report = self._judge(files, config, tests)
        if report is None:
            return None  # (the sandbox failed: unknown, not wrong)
        if not report["compiled"]:
            return 0.0
        scores = [points(out) for out, _ in report["results"]]
        scores += [0.0] * (len(names) - len(scores))  # (not run after a 0: open-r1's SKIPPED tests score 0)
        precision = row.get("score_precision")
        return round(min(scores), 2 if precision is None else int(precision))

    def _files(self, row: dict) -> dict[str, str]:
        graders = row.get("grader_files")
        if isinstance(graders, str):
            graders = json.loads(graders)
        pairs = graders.items() if isinstance(graders, dict) else graders or []
        return {path: content for path, content in pairs if content}

    def _config(self, row: dict, files: dict[str, str]) -> dict[str, Any]:
        """grader_config.json's keys over the row's task_type, time_limit (s) and memory_limit (MB, here bytes)."""
        config = {"task_type": row.get("task_type") or "Batch", "time_limit": float(row.get("time_limit") or 1.0),
                  "memory_limit": int(float(row.get("memory_limit") or 256)) << 20}
        if "graders/grader_config.json" in files:
            config.update(json.loads(files["graders/grader_config.json"]))
        if config["task_type"] not in TASK_TYPES:
            logger.warning("ioi_code: %s is a %s task, which is not judged here (scored None)", _label(row),
                           config["task_type"])
        return config

    def _tests(self, row: dict, names: list[str]) -> list[tuple[str, str]]:
        cases = row.get("test_cases")
        if isinstance(cases, str):
            cases = json.loads(cases)
        if cases is None:
            if not self.tests_dir:
                raise ValueError(f"ioi_code: {_label(row)} has no test_cases; {self.column_hint}")
            cases = load_tests(self.tests_dir, int(row["year"]), str(row["id"]))
        if isinstance(cases, list):
            cases = dict(zip(names, cases))
        missing = [name for name in names if cases.get(name) is None]
        if missing:
            raise ValueError(f"ioi_code: {_label(row)} names test {missing[0]!r} ({len(missing)} of {len(names)} "
                             "missing), which its test cases lack; check test_names against test_cases / tests_dir")
        return [_pair(cases[name]) for name in names]

    def _judge(self, files: dict[str, str], config: dict[str, Any], tests: list[tuple[str, str]]) -> dict | None:
        """The harness's report, or None when the sandbox failed."""
        sizes = [len(i) + len(o) for i, o in tests]
        biggest, total = max(sizes) >> 20, sum(sizes) >> 20
        spec = json.dumps({"files": files, "config": config, "tests": tests, "compile_s": COMPILE_S,
                           "checker_s": CHECKER_S})
        deadline = 3 * COMPILE_S + len(tests) * (float(config["time_limit"]) + CHECKER_S + 1.0)
        memory = max(2048, (int(config["memory_limit"]) >> 20) + 512) + 3 * total
        ran = run_harness(_HARNESS, spec, deadline, memory, self.allow_unsandboxed, max_processes=64,
                          tmpfs_mb=256 + 4 * biggest, file_size_mb=64 + 2 * biggest, max_output_bytes=1 << 20)
        return json.loads(ran.stdout) if ran.status == "ok" else None


ioi_code = IOI()
