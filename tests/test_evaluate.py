"""`grpo eval` and the metrics behind it: accuracy, format rate, pass@k, maj@k, checked on scripted completions."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

from grpo.cli import main
from grpo.config import GRPOConfig
from grpo.training.data.prompts import build_prompt_set
from grpo.training.evaluation.held_out import evaluate_prompts, extract_answer
from grpo.engines.base import SamplingParams, ScriptedGenerator
from grpo.rewards import RewardRunner, resolve_reward


def test_extract_answer():
    assert extract_answer("x</think>\n<answer> 14 </answer>") == "14"
    assert extract_answer("so \\boxed{7}") == "7"
    assert extract_answer("no answer here") is None


def test_pass_and_majority_over_k_samples(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Prompt 0 (answer 4): samples 4, 5, 5 -> pass@3 yes, maj@3 no (5 wins the vote).
    # Prompt 1 (answer 2): samples 2, 2, 3 -> pass@3 yes, maj@3 yes. Accuracy 3 of 6; format 6 of 6.
    script = {0: ["4", "5", "5"], 1: ["2", "2", "3"]}
    served = []

    def complete(prompt_ids, rng):
        prompt = 0 if "2 + 2" in tok.decode(prompt_ids) else 1
        k = sum(1 for p in served if p == prompt)
        served.append(prompt)
        return tok(f"x</think>\n<answer>{script[prompt][k]}</answer>", add_special_tokens=False)["input_ids"]

    data = Dataset.from_dict({"prompt": ["2 + 2\n", "1 + 1\n"], "answer": ["4", "2"]})
    cfg = GRPOConfig(task=None, max_prompt_length=None)
    prompts = build_prompt_set(data, tok, cfg, "<think>")
    funcs = [resolve_reward("math_accuracy"), resolve_reward("think_format")]
    result = evaluate_prompts(ScriptedGenerator(complete, [tok.eos_token_id]), tok, prompts, RewardRunner(funcs),
                              ["math_accuracy", "think_format"], SamplingParams(32), k=3)
    assert result["accuracy"] == 0.5 and result["pass@3"] == 1.0 and result["maj@3"] == 0.5
    assert result["format_rate"] == 1.0


def test_eval_command_on_a_dataset_writes_json(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 = ", "answer": str(i + 1)}) + "\n" for i in range(6)))
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", tiny_model_dir, "--dataset", str(data), "--reward-funcs", "math_accuracy",
                 "think_format", "--k", "2", "--max-completion-length", "8", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 6 and len(result["rows"]) == 6 and len(result["rows"][0]["completions"]) == 2
    assert 0.0 <= result["accuracy"] <= 1.0 and "pass@2" in result and "maj@2" in result
    assert "accuracy" in capsys.readouterr().out


def test_eval_rejects_a_path_that_is_no_model(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path)]) == 2
    assert "neither a model directory nor a run directory" in capsys.readouterr().err


def test_eval_json_into_a_missing_directory_is_written_there(tmp_path, tiny_model_dir, capsys):
    """Its directories are made, as output_dir's are (it was a FileNotFoundError traceback after the whole eval)."""
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 = ", "answer": str(i + 1)}) + "\n" for i in range(2)))
    out = tmp_path / "new" / "dir" / "eval.json"
    assert main(["eval", "--model", tiny_model_dir, "--dataset", str(data), "--reward-funcs", "math_accuracy",
                 "--max-completion-length", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["num_prompts"] == 2


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "grpo: error: --k: must be >= 1 (got 0)."),  # (was a ZeroDivisionError traceback)
    (["--n", "0"], "grpo: error: --n: must be >= 1 (got 0)."),
    (["--json", "{file}/eval.json"], "grpo: error: --json: cannot write {file}/eval.json ({file} is not a writable "
                                     "directory); give a file path in a directory you can write to."),
])
def test_bad_eval_flags_are_one_line_before_the_model_loads(tmp_path, tiny_model_dir, capsys, monkeypatch, flags,
                                                             message):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # (loading would fail loudly)
    file = tmp_path / "a-file"
    file.write_text("")
    flags = [f.replace("{file}", str(file)) for f in flags]
    assert main(["eval", "--model", tiny_model_dir, "--n", "2", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [message.replace("{file}", str(file))]


def test_eval_help_names_the_tasks_and_the_shipped_models(capsys):
    from grpo.config.base import SHIPPED_MODELS
    from grpo.tasks import TASKS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # (argparse wraps lines, at hyphens too)
    assert all(name in text.replace("- ", "-") for name in [*TASKS, *SHIPPED_MODELS]), text
