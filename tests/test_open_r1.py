"""open-r1 unchanged: its seven non-code reward functions (a copy of its rewards.py, tests/fixtures/, Apache-2.0)
run under the default config, where math-verify's signal.alarm needs the main thread; completions are
conversational exactly when the prompts are (open-r1's script makes [system, user] prompts: so does system_prompt
with a chat template); and a recipe in open-r1's form (its keys, local paths) loads and trains with `grpo train`."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.rewards import RewardRunner

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
r1 = pytest.importorskip("open_r1_rewards")  # needs math-verify and latex2sympy2_extended (grpo's math extra)

SEVEN = [r1.accuracy_reward, r1.format_reward, r1.tag_count_reward, r1.reasoning_steps_reward, r1.len_reward,
         r1.get_cosine_scaled_reward(), r1.get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0)]
SYSTEM = ("A conversation. The assistant thinks, then answers: <think>\n...\n</think>\n<answer>\n...\n</answer>")


def conversational(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_accuracy_needs_the_main_thread_and_runs_under_the_default_timeout():
    """math-verify's parse arms signal.alarm, which Python refuses off the main thread (where grpo ran synchronous
    rewards before, to bound them); the runner now calls them in the main thread, bounded by a signal of its own."""
    completions = conversational([r"<think>\nx\n</think>\n<answer>\n$\boxed{2}$\n</answer>", r"$\boxed{3}$"])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raises(r1.accuracy_reward, completions, ["$2$", "$2$"])))
    thread.start()
    thread.join()
    assert errors == ["ValueError"]  # what a reward thread got
    runner = RewardRunner([("accuracy", r1.accuracy_reward)], timeout_s=GRPOConfig().reward_timeout)
    out = runner([[{"role": "user", "content": "1+1?"}]] * 2, completions, [[1], [1]], {"solution": ["$2$", "$2$"]})
    assert out.per_func["accuracy"] == [1.0, 0.0] and out.timeouts == {"accuracy": 0}


def _raises(func, completions, solution):
    try:
        func(completions, solution)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__
    return None


def test_the_seven_rewards_by_hand():
    good = "<think>\nStep 1: add.\nStep 2: check.\nStep 3: done.\n</think>\n<answer>\n$\\boxed{2}$\n</answer>"
    bad = "the the the the the"
    out = RewardRunner([(f.__name__, f) for f in SEVEN], timeout_s=60.0)(
        [[{"role": "user", "content": "1+1?"}]] * 2, conversational([good, bad]), [[1], [1]],
        {"solution": ["$2$", "$2$"]})
    p = out.per_func
    assert p["accuracy_reward"] == [1.0, 0.0] and p["format_reward"] == [1.0, 0.0]
    assert p["tag_count_reward"] == [1.0, 0.0] and p["reasoning_steps_reward"] == [1.0, 0.0]
    # len_reward (Kimi 1.5): the correct one is the longer: 0.5 - (len - min) / (max - min) = 0.5 - 1 = -0.5; the
    # wrong one is the shortest: min(0, 0.5 - 0) = 0
    assert p["len_reward"] == pytest.approx([-0.5, 0.0])
    assert p["repetition_penalty_reward"][1] == pytest.approx(-1.0 * (1 - 1 / 3))  # 3 trigrams, 1 distinct


@pytest.mark.parametrize("system_prompt, prompt, want", [
    (None, "What is 1+1?", str),  # text stays text (TRL)
    (SYSTEM, "What is 1+1?", list),  # open-r1's make_conversation
    (None, [{"role": "user", "content": "What is 1+1?"}], list),  # messages stay messages
])
def test_completions_are_conversational_exactly_when_the_prompts_are(tiny_chat_model_dir, tmp_path, system_prompt,
                                                                     prompt, want):
    seen = []

    def probe(prompts, completions, **kwargs):
        seen.append((type(prompts[0]), type(completions[0])))
        return [0.0] * len(completions)

    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=2,
                     max_steps=1, max_completion_length=4, report_to=[], system_prompt=system_prompt)
    GRPOTrainer(model=tiny_chat_model_dir, reward_funcs=probe, args=cfg,
                train_dataset=Dataset.from_dict({"prompt": [prompt] * 2})).train()
    assert seen == [(want, want)]


def test_the_seven_rewards_train_under_the_default_config(tiny_chat_model_dir, tmp_path):
    data = Dataset.from_dict({"problem": ["What is 1+1?", "What is 2+2?"] * 2, "solution": ["$2$", "$4$"] * 2})
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), system_prompt=SYSTEM, num_generations=4,
                     per_device_train_batch_size=4, max_steps=2, max_completion_length=16, report_to=[])
    GRPOTrainer(model=tiny_chat_model_dir, reward_funcs=SEVEN, args=cfg, train_dataset=data).train()
    from grpo.training.observe.tracking import read_metrics

    last = read_metrics(tmp_path / "run")[-1]
    for func in SEVEN:
        assert f"reward/{func.__name__}" in last and last[f"reward/errors/{func.__name__}"] == 0
        assert last[f"reward/timeouts/{func.__name__}"] == 0


RECIPE = """\
# open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml keys, with a local model and dataset
# Model arguments
model_name_or_path: {model}
model_revision: main
torch_dtype: float32
attn_implementation: {attn}

# Data training arguments
dataset_name: {data}
dataset_prompt_column: problem
system_prompt: "{system}"

# GRPO trainer config
bf16: true
use_vllm: {vllm}
do_eval: false
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen2.5-1.5B-Open-R1-GRPO
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
max_prompt_length: 512
max_completion_length: 16
max_steps: 2
num_generations: 4
num_train_epochs: 1
output_dir: {out}
overwrite_output_dir: true
per_device_eval_batch_size: 4
per_device_train_batch_size: 2
push_to_hub: {push}
report_to:
{report}
reward_funcs:
- accuracy
- format
- tag_count
reward_weights:
- 1.0
- 1.0
- 1.0
save_strategy: "epoch"
save_total_limit: 1
seed: 42
temperature: 0.7
warmup_ratio: 0.1
"""


def test_an_open_r1_recipe_loads_and_trains(tiny_chat_model_dir, tmp_path, capsys):
    from grpo.cli import main

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "solution": f"${i + 1}$"}) + "\n"
                            for i in range(8)))
    recipe = tmp_path / "config_demo.yaml"
    as_published = dict(model=tiny_chat_model_dir, data=data, out=tmp_path / "published", system=SYSTEM.replace(
        "\n", "\\n"), attn="flash_attention_2", vllm="true", push="true", report="- wandb")
    recipe.write_text(RECIPE.format(**as_published))
    cfg = GRPOConfig.load(recipe)  # every key of the recipe is accepted as open-r1's script reads it
    assert (cfg.prompt_column, cfg.lr_scheduler_kwargs, cfg.log_completions) == ("problem", {"min_lr_rate": 0.1}, True)
    # With this machine's limits (no hub, no vLLM, no flash-attention, no wandb): the rest as published.
    recipe.write_text(RECIPE.format(**{**as_published, "out": tmp_path / "run", "attn": "sdpa", "vllm": "false",
                                       "push": "false", "report": "- tensorboard"}))
    assert main(["train", str(recipe)]) == 0
    from grpo.training.observe.tracking import read_metrics

    logged = read_metrics(tmp_path / "run")
    assert [r["step"] for r in logged] == [1, 2]
    assert {"reward/math_accuracy", "reward/r1_format", "reward/tag_count", "rewards/tag_count/mean"} <= set(logged[0])
    assert (tmp_path / "run" / "final" / "config.json").exists()


def test_the_timeout_still_bounds_a_reward_that_uses_signal_alarm():
    """math-verify arms and cancels SIGALRM inside parse; the runner's own deadline uses another signal, so a reward
    that parses and then hangs is still stopped."""
    import time

    from math_verify import parse

    def parses_then_hangs(completions, **kwargs):
        parse("$1 + 1$")  # signal.alarm(5) ... signal.alarm(0)
        time.sleep(30)
        return [0.0] * len(completions)

    runner = RewardRunner([("hangs", parses_then_hangs)], on_error="zero", timeout_s=0.5)
    started = time.monotonic()
    out = runner(["p"], ["c"], [[1]], {})
    assert out.timeouts == {"hangs": 1} and time.monotonic() - started < 20


# ---- every reward name of open-r1's get_reward_funcs, and its code rewards in grpo's sandbox -------------------------
# The keys of REWARD_FUNCS_REGISTRY in open-r1's get_reward_funcs (src/open_r1/rewards.py at huggingface/open-r1
# 1416fa0), in its order: all 13 resolve here
OPEN_R1_NAMES = ["accuracy", "format", "reasoning_steps", "cosine", "repetition_penalty", "length", "code",
                 "binary_code", "ioi_code", "cf_code", "code_format", "tag_count", "soft_overlong_punishment"]


def test_open_r1_reward_names_resolve():
    from grpo.training.setup.rewards import make_reward_runner

    cfg = GRPOConfig(code_language="cpp", code_eval_scoring_mode="partial")
    runner, names = make_reward_runner(cfg, OPEN_R1_NAMES, None)
    assert names == ["math_accuracy", "r1_format", "reasoning_steps", "cosine_length", "repetition_penalty",
                     "kimi_length", "code", "binary_code", "ioi_code", "cf_code", "code_format", "tag_count",
                     "soft_overlong"]
    assert len(runner.funcs) == len(OPEN_R1_NAMES) == 13
    funcs = dict(zip(names, runner.funcs))
    assert funcs["binary_code"].binary and not funcs["code"].binary
    assert funcs["code_format"].language == "cpp" and funcs["cf_code"].scoring_mode == "partial"  # (recipe keys)


def test_length_and_code_format_by_hand():
    from grpo.rewards.format import code_format
    from grpo.rewards.shaping import kimi_length

    texts = conversational(["$\\boxed{2}$", "$\\boxed{3}$ and more words", "$\\boxed{2}$ said at much more length"])
    # lengths 11, 26, 36: lam = 0.5 - (n - 11) / 25 = 0.5, -0.1, -0.5; the second is wrong: min(0, -0.1)
    assert kimi_length(texts, solution=["$2$"] * 3) == pytest.approx([0.5, -0.1, -0.5])
    # a wrong answer with a positive lam gets 0: the shortest (11) is wrong here
    assert kimi_length(texts, solution=["$3$"] * 3) == pytest.approx([0.0, -0.1, -0.5])
    assert kimi_length(conversational(["a", "b"]), solution=["$2$"] * 2) == [0.0, 0.0]  # all the same length
    good = "<think>\nplan\n</think>\n<answer>\n```python\nprint(1)\n```\n</answer>"
    assert code_format(conversational([good, good.replace("python", "cpp"), "```python\nprint(1)\n```"])) == [
        1.0, 0.0, 0.0]
    assert code_format(conversational([good.replace("python", "cpp")]), language=["cpp"]) == [1.0]  # (a column)


SUM = {"language": "python", "test_cases": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}]}


def fenced(program: str) -> list:
    return [{"role": "assistant", "content": f"<think>\nadd\n</think>\n<answer>\n```python\n{program}\n```\n</answer>"}]


@pytest.mark.skipif(not __import__("grpo.rewards.sandbox", fromlist=["x"]).probe_sandbox().isolated,
                    reason="no sandbox layers here")
def test_open_r1_code_rewards_read_verification_info_in_the_sandbox():
    from grpo.training.setup.rewards import make_reward_runner

    runner, names = make_reward_runner(GRPOConfig(), ["code", "binary_code"], None)
    right = fenced("a, b = map(int, input().split())\nprint(a + b)")
    half = fenced("a, b = map(int, input().split())\nprint(5)")  # passes the first test only
    wrong = fenced("print(0)")
    info = [json.dumps(SUM), SUM, SUM]  # (a JSON string, as the hub's column holds it, or the mapping)
    out = runner([[{"role": "user", "content": "add"}]] * 3, [right, half, wrong], [[1]] * 3,
                 {"verification_info": info})
    assert out.per_func["code"] == [1.0, 0.5, 0.0]  # open-r1's code: the pass rate
    assert out.per_func["binary_code"] == [1.0, 0.0, 0.0]  # binary_code: every test, or nothing


def test_open_r1_infrastructure_keys_are_accepted_and_skipped_with_one_line(caplog):
    import logging

    from grpo.training.trl_surface import warn_as_trl

    cfg = GRPOConfig(benchmarks=["lcb_v4"], callbacks=["push_to_hub_revision"])
    with caplog.at_level(logging.WARNING):
        warn_as_trl(cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "benchmarks lcb_v4 are skipped" in lines[0] and "push_to_hub_revision is skipped" in \
        lines[1]
    with pytest.raises(Exception, match="callbacks: .* not one of open-r1's callbacks"):
        GRPOConfig(callbacks=["my_callback"])


needs_sandbox = pytest.mark.skipif(not __import__("grpo.rewards.sandbox", fromlist=["x"]).probe_sandbox().isolated,
                                   reason="no sandbox layers here")


def codeforces_rows(n, **columns):
    tests = [{"input": "2 3\n", "output": "5\n"}, {"input": "1 1\n", "output": "2"}]
    base = dict(official_tests=[tests] * n, generated_checker=[None] * n, time_limit=[2.0] * n,
                memory_limit=[256] * n, input_mode=["stdio"] * n, language=["python"] * n)
    return {**base, **columns}


@needs_sandbox
def test_cf_code_judges_codeforces_rows_in_the_sandbox():
    from grpo.rewards.competitive import cf_code

    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\nprint(5)\n```"  # passes the first of two tests
    # weighted_sum: pass_fail + 0.1 x pass rate: 1 + 0.1, 0 + 0.05, 0; no code block: -1
    assert cf_code([good, half, "```python\nprint(0)\n```", "no code"], **codeforces_rows(4)) == pytest.approx(
        [1.1, 0.05, 0.0, -1.0])
    assert cf_code.configure(scoring_mode="partial")([good, half], **codeforces_rows(2)) == [1.0, 0.5]
    # input_mode file: input.txt in, output.txt out (what it prints is discarded)
    files = "```python\na, b = map(int, open('input.txt').read().split())\nopen('output.txt', 'w').write(str(a + b))" \
            "\nprint('noise')\n```"
    assert cf_code([files, good], **codeforces_rows(2, input_mode=["file"] * 2)) == pytest.approx([1.1, 0.0])
    # without a checker "yes" matches "YES" (Piston's normalisation); this checker compares tokens exactly
    checker = "import sys\nprint(1 if open(sys.argv[2]).read().split() == open(sys.argv[3]).read().split() else 0)\n"
    yes = [{"input": "x\n", "output": "YES\n"}]
    says_yes = "```python\nprint('yes')\n```"
    assert cf_code([says_yes, says_yes], **codeforces_rows(2, official_tests=[yes] * 2,
                                                           generated_checker=[None, checker])) == [1.1, 0.0]
    # a language not built here (Java) does not apply (None), nor does a row without tests
    rows = codeforces_rows(2, language=["java", "python"], official_tests=[[{"input": "", "output": ""}], []])
    assert cf_code(["```java\nclass A {}\n```", good], **rows) == [None, None]


@needs_sandbox
def test_cf_code_compiles_and_runs_cpp_in_the_sandbox():
    from grpo.rewards.competitive import cf_code

    good = ("```cpp\n#include <bits/stdc++.h>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b; }"
            "\n```")
    half = "```cpp\n#include <cstdio>\nint main() { printf(\"5\\n\"); }\n```"
    broken = "```cpp\nint main( {\n```"
    spins = "```cpp\nint main() { for (;;); }\n```"  # past the 1 s time limit on both tests
    python_block = "```python\nprint(5)\n```"  # no ```cpp block: no submission
    rows = codeforces_rows(5, language=["cpp"] * 5, time_limit=[1.0] * 5)
    # 1 + 0.1, 0 + 0.1 x 1/2, open-r1's no_compile_reward, 0, no_submission_reward
    assert cf_code([good, half, broken, spins, python_block], **rows) == pytest.approx([1.1, 0.05, -0.1, 0.0, -1.0])
    files = ("```cpp\n#include <cstdio>\nint main() { long long a, b; FILE *f = fopen(\"input.txt\", \"r\");"
             " fscanf(f, \"%lld %lld\", &a, &b); fprintf(fopen(\"output.txt\", \"w\"), \"%lld\", a + b); }\n```")
    assert cf_code([files], **codeforces_rows(1, language=["cpp"], input_mode=["file"])) == pytest.approx([1.1])


# ---- open-r1's other GRPO recipes: their keys, with a local model and data, this machine's limits and a short run --
CODE_RECIPE = {  # recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo_code.yaml, its keys beyond config_demo's
    "dataset_prompt_column": "problem_statement", "beta": 0.01, "learning_rate": 5.0e-06, "max_prompt_length": 1024,
    "reward_funcs": ["code", "format"], "reward_weights": [1.0, 0.1], "save_strategy": "steps", "save_steps": 50,
    "temperature": 1.0, "warmup_ratio": 0.03}
CODEFORCES_RECIPE = {  # recipes/Qwen2.5-Coder-7B-Instruct/grpo/config_codeforces.yaml, likewise
    "dataset_prompt_column": "prompt", "dataset_config": "verifiable-prompts", "dataset_test_split": "test",
    "dataset_train_split": "train", "callbacks": ["push_to_hub_revision"], "benchmarks": ["lcb_v4"], "beta": 0.0,
    "loss_type": "dr_grpo", "scale_rewards": False, "eval_strategy": "no", "vllm_device": "auto",
    "vllm_gpu_memory_utilization": 0.7, "hub_model_revision": "v01.00", "lr_scheduler_type": "constant_with_warmup",
    "lr_scheduler_kwargs": None, "max_grad_norm": 0.2, "max_prompt_length": 2000,
    "reward_funcs": ["cf_code", "code_format"],
    "reward_weights": [1.0, 0.1], "save_strategy": "steps", "save_steps": 0.05, "wandb_entity": "huggingface",
    "wandb_project": "open-r1", "mask_truncated_completions": True, "code_eval_test_batch_size": -1,
    "code_eval_scoring_mode": "weighted_sum"}
IOI_RECIPE = {  # recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo_code_ioi.yaml, likewise
    "dataset_prompt_column": "problem", "beta": 0.01, "learning_rate": 5.0e-06, "max_prompt_length": 1024,
    "save_strategy": "steps", "save_steps": 50, "temperature": 1.0, "warmup_ratio": 0.03, "code_language": "cpp",
    "reward_funcs": ["ioi_code", "code_format", "format"], "reward_weights": [1.0, 0.1, 0.1],
    "code_eval_test_batch_size": 3}
# open-r1's 5 GRPO recipes (recipes/*/grpo/*.yaml at 1416fa0), each trained a step here: config_demo
# (test_an_open_r1_recipe_loads_and_trains), DeepSeek-R1-Distill-Qwen-1.5B's config_demo
# (test_the_deepseek_recipe_trains_a_step), config_demo_code, config_codeforces and config_demo_code_ioi (below)


def recipe_file(tmp_path, model, data, keys) -> Path:
    import yaml

    base = yaml.safe_load(RECIPE.format(model=model, data=data, out=tmp_path / "run", system=SYSTEM.replace(
        "\n", "\\n"), attn="sdpa", vllm="false", push="false", report="- tensorboard"))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**base, **keys, "max_steps": 1}))
    return path


@needs_sandbox
@pytest.mark.parametrize("name", ["code", "codeforces", "ioi"])
def test_open_r1_code_recipes_train_a_step(tiny_chat_model_dir, tmp_path, name):
    from grpo.cli import main
    from grpo.training.observe.tracking import read_metrics

    data = tmp_path / "problems.jsonl"
    if name == "code":
        rows = [{"problem_statement": f"Print {i}.", "verification_info": json.dumps(
            {"language": "python", "test_cases": [{"input": "", "output": f"{i}\n"}]})} for i in range(8)]
        keys, columns = CODE_RECIPE, ("reward/code", "reward/r1_format")
    elif name == "codeforces":
        rows = [{"prompt": f"Print {i}.", "official_tests": [{"input": "", "output": f"{i}\n"}],
                 "generated_checker": None, "time_limit": 1.0, "memory_limit": 256.0, "input_mode": "stdio",
                 "language": "python"} for i in range(8)]
        keys, columns = CODEFORCES_RECIPE, ("reward/cf_code", "reward/code_format")
    else:  # open-r1/ioi's columns, one row per subtask, the tests in test_cases (tests/fixtures/ioi_problem.py)
        import ioi_problem

        rows = [ioi_problem.subtask_row(1 + i % 2) for i in range(8)]
        keys, columns = IOI_RECIPE, ("reward/ioi_code", "reward/code_format", "reward/r1_format")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", str(recipe_file(tmp_path, tiny_chat_model_dir, data, keys))]) == 0
    logged = read_metrics(tmp_path / "run")
    assert [r["step"] for r in logged] == [1] and set(columns) <= set(logged[0])
    assert logged[0][f"{columns[0]}/none_frac"] == 0.0  # (every row judged: its tests were found)
    assert (tmp_path / "run" / "final" / "config.json").exists()


# recipes/DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml: config_demo's keys with its own chat template (here a
# short one of the same form: the system prompt first, then <｜User｜> / <｜Assistant｜> turns) and temperature
DEEPSEEK_TEMPLATE = ("{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
                     "{% set ns.system = m['content'] %}{% endif %}{% endfor %}{{ ns.system }}{% for m in messages %}"
                     "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
                     "{% elif m['role'] == 'assistant' %}"
                     "{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")


def test_the_deepseek_recipe_trains_a_step(tiny_chat_model_dir, tmp_path):
    from grpo.cli import main
    from grpo.training.observe.tracking import read_metrics

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "solution": f"${i + 1}$"}) + "\n"
                            for i in range(8)))
    keys = {"chat_template": DEEPSEEK_TEMPLATE, "learning_rate": 1.0e-06, "max_completion_length": 16,
            "temperature": 0.7, "use_liger_kernel": False}  # (use_liger_kernel: true needs Liger on a GPU)
    assert main(["train", str(recipe_file(tmp_path, tiny_chat_model_dir, data, keys))]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]
