"""open-r1's `ioi_code` in grpo's sandbox: a tiny IOI-style problem (tests/fixtures/ioi_problem.py: a header, a
grader, grader_config.json, two subtasks; a CMS checker and a Communication manager in variants) judged as open-r1's
Piston package judges it. The reward of a row (one subtask) is the minimum of its tests' scores, not scaled by the
subtask's points."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from grpo.rewards.ioi import IOI, add_includes, ioi_code
from grpo.rewards.sandbox import probe_sandbox

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import ioi_problem as p  # noqa: E402

needs_sandbox = pytest.mark.skipif(not probe_sandbox().isolated, reason="no sandbox layers here")


def score(solutions: list[str], rows: list[dict], reward=ioi_code) -> list:
    return reward([p.completion(s) for s in solutions], **p.columns(rows))


@needs_sandbox
def test_batch_subtasks_score_as_open_r1_scores_them():
    one, two = p.subtask_row(1), p.subtask_row(2)
    # correct: every test of both subtasks passes -> 1.0 each (not 40 and 60: the points do not scale the reward);
    # partial (v[0] + v[1]): both n = 2 tests of subtask 1 pass -> 1.0; subtask 2's 2-01 (n = 3) prints 3, not 6 -> 0;
    # wrong (v.size()): 1-01 prints 2, not 7 -> 0; broken: does not compile -> 0
    solutions = [p.CORRECT, p.CORRECT, p.PARTIAL, p.PARTIAL, p.WRONG, p.BROKEN]
    assert score(solutions, [one, two, one, two, one, two]) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # past the 1 s time limit -> 0; no ```cpp block (a python one) -> 0, as open-r1 skips the grading
    texts = [p.completion(p.SPINS), p.completion("print(7)", "python")]
    assert ioi_code(texts, **p.columns([one, one])) == [0.0, 0.0]


@needs_sandbox
def test_a_checker_gives_partial_scores_rounded_to_the_score_precision():
    two = p.subtask_row(2, checker=True)
    # partial on subtask 2: 2-01 prints 3 = 1 + 2, the checker's 0.333333; 2-02 prints 10, right: 1.
    # min(0.333333, 1) = 0.333333, rounded to score_precision 2 -> 0.33 (and 0.333 at precision 3)
    assert score([p.PARTIAL, p.CORRECT, p.WRONG], [two] * 3) == [0.33, 1.0, 0.0]
    assert score([p.PARTIAL], [{**two, "score_precision": 3}]) == [0.333]


@needs_sandbox
def test_a_communication_task_runs_the_manager_with_the_user_processes_over_fifos():
    std_io, fifo_io = p.subtask_row(2, communication="std_io"), p.subtask_row(2, communication="fifo_io")
    # the manager prints 1 when the user process(es) return the sum: correct 1.0; partial fails 2-01 (3 for 6) -> 0
    assert score([p.CORRECT, p.PARTIAL, p.CORRECT], [std_io, std_io, fifo_io]) == [1.0, 0.0, 1.0]


@needs_sandbox
def test_the_tests_come_from_the_row_or_from_a_local_copy_of_open_r1_ioi_test_cases(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    one, two = p.subtask_row(1), p.subtask_row(2)
    as_list = {**two, "test_cases": [{"input": i, "output": o} for i, o in (p.TESTS[n] for n in two["test_names"])]}
    as_json = {**one, "test_cases": __import__("json").dumps(one["test_cases"])}
    assert score([p.PARTIAL, p.PARTIAL], [as_list, as_json]) == [0.0, 1.0]
    # the hub's layout, <year>/*.parquet, one row per test; another problem's rows beside them are not read
    folder = tmp_path / "ioi-test-cases" / "2024"
    folder.mkdir(parents=True)
    names = list(p.TESTS) + ["1-01"]
    table = {"year": [2024] * 5, "problem_id": ["sumof"] * 4 + ["other"], "test_name": names,
             "test_input": [p.TESTS[n][0] for n in p.TESTS] + ["2\n0 0\n"],
             "test_output": [p.TESTS[n][1] for n in p.TESTS] + ["999\n"]}
    pq.write_table(pa.table(table), folder / "train-00000-of-00001.parquet")
    from_disk = IOI(tests_dir=str(tmp_path / "ioi-test-cases"))
    rows = [{k: v for k, v in row.items() if k != "test_cases"} for row in (one, two)]
    assert score([p.PARTIAL, p.PARTIAL], rows, from_disk) == [1.0, 0.0]
    assert ("year",) in from_disk.column_requirements and ("test_cases",) in ioi_code.column_requirements


def test_bad_rows_are_named_and_rows_it_cannot_judge_score_none():
    from grpo.rewards import RewardError, RewardRunner

    one = p.subtask_row(1)
    bare = {k: v for k, v in one.items() if k != "test_cases"}
    with pytest.raises(ValueError, match="ioi_code: problem 'sumof' subtask '1' has no test_cases; give each row"):
        score([p.CORRECT], [{**bare, "test_cases": None}])
    with pytest.raises(ValueError, match="names test '1-02' .1 of 2 missing."):
        score([p.CORRECT], [{**one, "test_cases": {"1-01": ["2\n1 1\n", "2\n"]}}])
    runner = RewardRunner([("ioi_code", ioi_code)])
    with pytest.raises(RewardError, match="needs column 'test_cases'.*; give each row its tests in a test_cases "
                                          "column, or the reward a tests_dir"):
        runner.check_columns(list(bare))
    # OutputOnly (the submission is a file of answers) and a row without tests are not judged here
    assert score([p.CORRECT, p.CORRECT], [{**one, "task_type": "OutputOnly", "grader_files": []},
                                         {**one, "test_names": []}]) == [None, None]


def test_add_includes_is_open_r1s():
    assert add_includes("int f() { return 1; }", "sumof") == (
        '#include <bits/stdc++.h>\n#include "sumof.h"\n\nusing namespace std;\n\nint f() { return 1; }')
    own = '#include "sumof.h"\nstd::vector<int> g();'
    assert add_includes(own, "sumof") == "#include <bits/stdc++.h>\n" + own
    assert add_includes("", "sumof") == ""
