"""Built-in tasks: reproducible, disjoint splits, correct answers, a working difficulty knob, solvable countdowns."""

import ast
import json
import operator
import re
from fractions import Fraction
from pathlib import Path

import pytest

from grpo.tasks import TASKS, Task, export, get_task
from grpo.tasks import arithmetic, countdown

# The tutorial seed's format regex, applied to prefill + completion.
FORMAT_RE = re.compile(r"^<think>([^<]*(?:<(?!/?think>)[^<]*)*)<\/think>\n<answer>([\s\S]*?)<\/answer>$")
STEP_RE = re.compile(r"^\s*(.+?) = (-?\d+)\s*$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def reference_value(text: str) -> Fraction:
    """An evaluator independent of the task code: Python's own parser and precedence, exact fractions."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unexpected node {ast.dump(node)} in {text!r}")

    return walk(ast.parse(text, mode="eval"))


def test_registry_and_interface():
    assert set(TASKS) == {"arithmetic", "countdown", "calculator", "shapes"}
    task = get_task("arithmetic")
    assert isinstance(task, Task)
    assert task.reward_funcs == ["math_accuracy", "think_format"]
    assert len(task.reward_weights) == len(task.reward_funcs)
    assert task.prefill == "<think>" and task.step_reward == "arithmetic_steps"
    assert get_task("countdown").reward_funcs == ["countdown", "think_format"]
    with pytest.raises(ValueError, match="arithmetic.*countdown"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="validation"):
        task.dataset("validation", n=1)
    with pytest.raises(ValueError, match="no knob.*colour"):
        task.dataset("train", n=1, colour="red")


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "calculator"])
def test_same_seed_same_rows_other_seed_other_rows(name):
    task = get_task(name)
    first = task.dataset("train", n=50, seed=3).to_list()
    assert first == task.dataset("train", n=50, seed=3).to_list()
    assert first != task.dataset("train", n=50, seed=4).to_list()
    # A longer request extends the shorter one: the stream depends on the seed, not on n.
    assert task.dataset("train", n=80, seed=3).to_list()[:50] == first


# Small problem spaces (6,804 arithmetic problems; countdown with numbers 1..6 and targets up to 12), so that
# splits drawn without the held-out rule would share many problems.
@pytest.mark.parametrize("name, knobs", [("arithmetic", {}), ("countdown", {"max_number": 6, "max_target": 12}),
                                         ("calculator", {"max_digits": 2})])
def test_no_test_problem_appears_in_train(name, knobs):
    task = get_task(name)
    train, test = task.dataset("train", n=2000, seed=0, **knobs), task.dataset("test", n=300, seed=1, **knobs)

    def problem(row):  # countdown: a reordering of the same numbers is the same problem
        return row["prompt"] if name != "countdown" else (row["target"], tuple(sorted(row["nums"])))

    train_problems, test_problems = {problem(r) for r in train}, {problem(r) for r in test}
    assert not train_problems & test_problems
    assert len(test_problems) > 20  # the held-out split is not degenerate


def test_calculator_problems_need_the_tool_and_their_answers_are_right():
    task = get_task("calculator")
    assert task.tools == ("calculator",) and task.reward_funcs == ["math_accuracy"] and task.prefill == ""
    rows = task.dataset("train", n=400, seed=0)
    for row in rows:
        assert row["prompt"] == f"What is {row['expression']}?"
        assert Fraction(row["answer"]) == reference_value(row["expression"])
    digits = [max(len(x) for x in row["expression"].split()[::2]) for row in rows]
    # operand lengths uniform in 1..3: about 1/9 of problems have two one-digit operands
    assert set(digits) == {1, 2, 3} and 0.05 < digits.count(1) / len(digits) < 0.2
    assert {len(x) for row in task.dataset("train", n=200, seed=0, difficulty=3)
            for x in row["expression"].split()[::2]} == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="unknown difficulty 7"):
        task.dataset("train", n=1, difficulty=7)


def test_arithmetic_answers_match_an_independent_evaluator():
    for difficulty in (1, 2, 3, 4):
        for row in get_task("arithmetic").dataset("train", n=200, seed=0, difficulty=difficulty):
            assert row["prompt"] == f"Calculate {row['expression']}\n"
            assert Fraction(int(row["answer"])) == reference_value(row["expression"])


def test_arithmetic_worked_solution_is_one_correct_operation_per_line_in_format():
    for row in get_task("arithmetic").dataset("train", n=300, seed=0, difficulty=3):
        completion = row["gold_completion"]
        match = FORMAT_RE.search("<think>" + completion)
        assert match is not None, completion
        assert match.group(2) == row["answer"]
        lines = match.group(1).splitlines()
        for line in lines:
            lhs, rhs = STEP_RE.match(line).groups()
            assert len(re.findall(r"(?<=\d) [-+*] ", lhs)) == 1, line  # exactly one binary operation
            assert reference_value(lhs) == int(rhs), line
        assert lines[-1].endswith(f"= {row['answer']}")


def test_steps_respect_precedence_and_parentheses():
    # 2 + 2 * 6: the product first (the seed's example, answer 14); (2 + 3) * 4: the group first.
    assert arithmetic.solve(arithmetic.parse_expression("2 + 2 * 6")) == (["2 * 6 = 12", "2 + 12 = 14"], 14)
    assert arithmetic.solve(arithmetic.parse_expression("(2 + 3) * 4")) == (["2 + 3 = 5", "5 * 4 = 20"], 20)
    # Left to right within one precedence class: 1 - 5 - 6 = (1 - 5) - 6 = -10, not 1 - (5 - 6) = 2.
    assert arithmetic.solve(arithmetic.parse_expression("1 - 5 - 6")) == (["1 - 5 = -4", "-4 - 6 = -10"], -10)


def test_perturbed_step_propagates_to_the_answer():
    # A teacher that adds 1 to every result: 2 * 6 -> 13, then 2 + 13 = 15 -> 16.
    steps, value = arithmetic.solve(arithmetic.parse_expression("2 + 2 * 6"), perturb=lambda c: c + 1)
    assert steps == ["2 * 6 = 13", "2 + 13 = 16"] and value == 16


def test_parse_round_trips_and_rejects_garbage():
    for row in get_task("arithmetic").dataset("train", n=100, seed=0, difficulty=4):
        assert arithmetic.format_items(arithmetic.parse_expression(row["expression"])) == row["expression"]
    for bad in ("2 +", "(2 + 3", "2 ** 3", "x + 1", "2 + 3)"):
        with pytest.raises(ValueError):
            arithmetic.parse_expression(bad)


def test_difficulty_knob_changes_the_distribution():
    def stats(**knobs):
        rows = get_task("arithmetic").dataset("train", n=400, seed=0, **knobs)
        operands = [list(map(int, re.findall(r"\d+", r["expression"]))) for r in rows]
        return (
            {len(o) for o in operands},
            max(max(o) for o in operands),
            any("(" in r["expression"] for r in rows),
        )

    assert stats(difficulty=1) == ({2}, 9, False)
    assert stats(difficulty=2) == ({2, 3}, 9, False)
    assert stats(difficulty=3) == ({2, 3, 4}, 20, True)
    assert stats(difficulty=4) == ({3, 4, 5}, 50, True)
    # A knob overrides one field of the level.
    assert stats(difficulty=2, max_operand=99)[1] > 9
    with pytest.raises(ValueError, match="difficulty"):
        get_task("arithmetic").dataset("train", n=1, difficulty=9)
    with pytest.raises(ValueError, match="min_operands"):
        get_task("arithmetic").dataset("train", n=1, min_operands=4, max_operands=3)


def test_countdown_problems_are_solvable_with_every_number_once():
    rows = get_task("countdown").dataset("train", n=300, seed=0)
    assert {len(r["nums"]) for r in rows} == {3, 4}
    for row in rows:
        expression = row["expression"]
        assert sorted(map(int, re.findall(r"\d+", expression))) == sorted(row["nums"])
        assert reference_value(expression) == row["target"]
        assert 1 <= row["target"] <= 100 and all(1 <= x <= 99 for x in row["nums"])
        assert f"Using the numbers {row['nums']}, create an equation that equals {row['target']}." in row["prompt"]
        match = FORMAT_RE.search("<think>" + row["gold_completion"])
        assert match is not None and match.group(2) == expression
        for line in match.group(1).splitlines():  # every intermediate result is a positive integer
            lhs, rhs = STEP_RE.match(line).groups()
            assert reference_value(lhs) == int(rhs) > 0


def test_countdown_render_adds_only_needed_parentheses():
    assert countdown.render(("-", 8, ("+", 1, 2))) == "8 - (1 + 2)"
    assert countdown.render(("+", ("-", 8, 1), 2)) == "8 - 1 + 2"
    assert countdown.render(("*", ("+", 1, 2), 3)) == "(1 + 2) * 3"
    assert countdown.render(("/", 12, ("*", 2, 3))) == "12 / (2 * 3)"


def test_export_writes_valid_jsonl(tmp_path):
    paths = export("countdown", tmp_path / "cd", n_train=7, n_test=3, seed=0)
    train = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    test = [json.loads(line) for line in paths["test"].read_text().splitlines()]
    assert (len(train), len(test)) == (7, 3)
    assert train == get_task("countdown").dataset("train", n=7, seed=0).to_list()
    assert isinstance(train[0]["target"], int) and isinstance(train[0]["nums"], list)


def test_shipped_example_data_matches_the_generator():
    # examples/data/<task>/{train,test}.jsonl are exports of seed 0 at default knobs; regenerate with `export`.
    root = Path(__file__).resolve().parents[1] / "examples" / "data"
    for name in set(TASKS) - {"shapes"}:  # (shapes' rows hold PIL images: no JSONL export; tests/test_vision.py)
        for split in ("train", "test"):
            rows = [json.loads(line) for line in (root / name / f"{split}.jsonl").read_text().splitlines()]
            assert rows == get_task(name).dataset(split, n=len(rows), seed=0).to_list()


def test_held_out_rows_are_distinct_problems():
    # The default job's claim is measured on 500 held-out problems: they must be 500 different ones.
    rows = get_task("arithmetic").dataset("test", n=500, seed=0)
    assert len(set(rows["expression"])) == 500
    with pytest.raises(ValueError, match="held-out problems are distinct"):
        get_task("arithmetic").dataset("test", n=200, seed=0, difficulty=1)  # ~49 held-out problems exist


def test_a_task_data_file_takes_the_tasks_prefill_and_rewards(tmp_path):
    """A data file in a built-in task's format trains with the task's <think> prefill and rewards when the task is
    named beside it (without the prefill the shipped model scores zero); alone, it is plain data."""
    from pathlib import Path

    from grpo import GRPOConfig, GRPOTrainer

    data = str(Path(__file__).parent.parent / "examples" / "data" / "arithmetic" / "train.jsonl")
    with_task = GRPOTrainer(args=GRPOConfig(task="arithmetic", dataset_name=data, output_dir=str(tmp_path / "a"),
                                            report_to=[]))
    assert with_task.prefill == "<think>" and with_task.reward_names == ["math_accuracy", "think_format"]
    think = with_task.tokenizer.encode("<think>", add_special_tokens=False)
    assert with_task.train_set.prompt_ids[0][-len(think):] == think
    plain = GRPOTrainer(args=GRPOConfig(dataset_name=data, reward_funcs=["math_accuracy"],
                                        output_dir=str(tmp_path / "b"), report_to=[]))
    assert plain.prefill == "" and plain.task is None
