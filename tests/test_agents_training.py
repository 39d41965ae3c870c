"""Multi-turn rollouts in training: the loss mask token by token, environment_factory, rollout_func, config errors."""

from __future__ import annotations

import json
import time

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.agents.template import ToolTemplate
from grpo.config import ConfigError
from grpo.core import LossSettings, policy_loss
from grpo.engines.base import ScriptedGenerator, row_seed

CALL = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": "6 * 7"}}) + "\n</tool_call>"


def config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(tmp_path / "run"), task="calculator", num_generations=2, prompts_per_step=2,
                  max_completion_length=200, max_steps=1, report_to=[], save_steps=0, task_train_size=20,
                  task_eval_size=0, learning_rate=1e-3, log_completions_steps=0, beta=0.0, seed=3)
    values.update(overrides)
    return GRPOConfig(**values)


def turns_model(tokenizer, turns: list[str]) -> ScriptedGenerator:
    """Says turns[k] (then EOS) as its k-th turn: k counts the tool answers already in its context."""
    answer = tokenizer.convert_tokens_to_ids("<tool_response>")

    def complete(ids, rng):
        k = min(ids.count(answer), len(turns) - 1)
        return tokenizer(turns[k], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    return ScriptedGenerator(complete, [tokenizer.eos_token_id])


def make_trainer(tmp_path, model_dir, turns, **kwargs) -> GRPOTrainer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    overrides = kwargs.pop("overrides", {})
    return GRPOTrainer(model=model_dir, args=config(tmp_path, **overrides), generator=turns_model(tok, turns),
                       **kwargs)


def test_the_loss_mask_is_the_models_tokens_token_by_token(tmp_path, tools_model_dir):
    trainer = make_trainer(tmp_path, tools_model_dir, [CALL, "<answer>42</answer>"])
    tok = trainer.tokenizer
    batch = trainer.rollout()
    eos = [tok.eos_token_id]
    first = tok(CALL, add_special_tokens=False)["input_ids"] + eos
    last = tok("<answer>42</answer>", add_special_tokens=False)["input_ids"] + eos
    answer = ToolTemplate(tok).suffix_ids([{"role": "tool", "name": "calculator", "content": "42"}])
    completion = first + answer + last
    T = batch.completion_width
    assert T == len(completion)  # every row is this conversation
    for row in range(batch.input_ids.shape[0]):
        assert batch.input_ids[row, -T:].tolist() == completion
        assert batch.attention_mask[row, -T:].tolist() == [1] * T  # tool answers are in the forward pass...
        assert batch.completion_mask[row].tolist() == [1.0] * len(first) + [0.0] * len(answer) + [1.0] * len(last)
    model_tokens = len(first) + len(last)  # ...and out of the loss
    assert batch.metrics["completion/mean_length"] == model_tokens
    assert batch.metrics["tools/model_token_frac"] == pytest.approx(model_tokens / T)
    assert batch.metrics["tools/calls_per_completion"] == 1.0 and batch.metrics["tools/turns_per_completion"] == 2.0

    # The gradient of the loss the trainer takes, at logp = old_logp (ratio 1, inside the clip range, so
    # d l_it / d logp_it = -A_i): sequence_mean gives -A_i / (n_i * N) on each of row i's n_i model tokens and 0 on
    # every tool token, where n_i counts the model's tokens only.
    N = batch.input_ids.shape[0]
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0])[:N]
    logp = torch.full((N, T), -1.0, requires_grad=True)
    out = policy_loss(logp, logp.detach(), advantages, batch.completion_mask, LossSettings(aggregation="sequence_mean"))
    out.loss.backward()
    expected = -advantages[:, None] / (model_tokens * N) * batch.completion_mask
    assert torch.allclose(logp.grad, expected, atol=1e-9)
    assert (logp.grad[:, len(first):len(first) + len(answer)] == 0).all()


def test_a_training_step_runs_and_its_samples_show_the_whole_conversation(tmp_path, tools_model_dir):
    trainer = make_trainer(tmp_path, tools_model_dir, [CALL, "<answer>42</answer>"],
                           overrides={"log_completions_steps": 1, "beta": 0.04})
    metrics = trainer.train()
    assert metrics["tools/call_rate"] == 1.0 and metrics["policy/kl_divergence"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert "<tool_response>\n42\n</tool_response>" in rows[0]["completion"]
    assert rows[0]["completion"].endswith("<answer>42</answer>") and rows[0]["tool_calls"] == 1


# ---- environment_factory -----------------------------------------------------------------------------------------
class Counter:
    made: list = []

    def __init__(self):
        Counter.made.append(self)
        self.resets, self.total = [], 0

    def reset(self, **row):
        self.resets.append(row)
        self.total = row["start"]
        return f" Start at {row['start']}."

    def add(self, n: int) -> str:
        """Add to the count.

        Args:
            n: how much to add
        """
        self.total += n
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)


class Echo:
    def reset(self, **row):
        assert "environment" not in row
        return None

    def say(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: what to repeat
        """
        time.sleep(float(text))
        return text


def env_data(n: int = 4, environments=None) -> Dataset:
    rows = {"prompt": [f"Count {i}." for i in range(n)], "start": list(range(n))}
    if environments is not None:
        rows["environment"] = environments
    return Dataset.from_dict(rows)


ADD = "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"n": 5}}) + "\n</tool_call>"


def test_environment_methods_are_tools_reset_extends_the_prompt_and_get_reward_scores(tmp_path, tools_model_dir):
    Counter.made.clear()
    trainer = make_trainer(tmp_path, tools_model_dir, [ADD, "<answer>done</answer>"], environment_factory=Counter,
                           train_dataset=env_data(), overrides={"task": None, "max_steps": 2})
    assert trainer.reward_names == ["Counter"]  # the environment's reward alone (no reward_funcs given)
    assert len(Counter.made) == 1  # probed once, for its tools
    batch = trainer.rollout()
    prompts = trainer.tokenizer.batch_decode(batch.input_ids[:, :-batch.completion_width], skip_special_tokens=True)
    starts = [e.resets[-1]["start"] for e in Counter.made]
    for text, start in zip(prompts, starts):
        assert text.startswith("system\ntools: add") and text.endswith(f"Count {start}. Start at {start}.\nassistant\n")
    assert batch.metrics["reward/Counter"] == pytest.approx(sum(s + 5 for s in starts) / 4)
    assert {e.resets[-1]["prompt"] for e in Counter.made} == {f"Count {s}." for s in starts}
    instances = list(Counter.made)
    assert len(instances) == 4  # one per completion (2 prompts x 2), the probed one among them
    trainer.step += 1
    trainer.rollout()
    assert Counter.made == instances and all(len(e.resets) == 2 for e in instances)  # reused, reset again


def test_a_dict_of_environments_routes_rows_by_their_environment_column(tmp_path, tools_model_dir):
    Counter.made.clear()

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    say = "<tool_call>\n" + json.dumps({"name": "say", "arguments": {"text": "0"}}) + "\n</tool_call>"
    trainer = make_trainer(tmp_path, tools_model_dir, [ADD + say, "<answer>x</answer>"], reward_funcs=[zero],
                           environment_factory={"count": Counter, "echo": Echo},
                           train_dataset=env_data(4, ["count", "echo", "count", "echo"]),
                           overrides={"task": None, "prompts_per_step": 4, "max_completion_length": 400})
    batch = trainer.rollout()
    prompts = trainer.tokenizer.batch_decode(batch.input_ids[:, :-batch.completion_width], skip_special_tokens=True)
    # each row offers its own environment's tools (rows "Count 0." and "Count 2." count, the others echo)...
    for text in prompts:
        row = int(text.split("Count ")[1][0])
        assert text.split("\n")[1] == ("tools: add" if row % 2 == 0 else "tools: say")
    # ...and calling the other environment's tool is calling an unknown tool
    assert batch.metrics["tools/errors/unknown_tool"] == 8.0  # one of the two calls of each of the 8 rows
    assert batch.metrics["reward/Counter/none_frac"] == 0.5  # echo rows: does not apply


def test_remove_unused_columns_keeps_the_column_that_picks_each_rows_environment(tmp_path, tools_model_dir):
    seen = []

    def zero(completions, **kwargs):
        seen.append(sorted(kwargs))
        return [0.0] * len(completions)

    say = "<tool_call>\n" + json.dumps({"name": "say", "arguments": {"text": "0"}}) + "\n</tool_call>"
    trainer = make_trainer(tmp_path, tools_model_dir, [say, "<answer>x</answer>"], reward_funcs=[zero],
                           environment_factory={"a": Echo, "b": Echo}, train_dataset=env_data(4, ["a", "b"] * 2),
                           overrides={"task": None, "prompts_per_step": 4, "remove_unused_columns": True})
    batch = trainer.rollout()
    assert batch.metrics["tools/call_rate"] == 1.0 and batch.metrics["tools/errors/unknown_tool"] == 0.0
    assert "environment" in seen[0] and "start" not in seen[0]  # the other columns are dropped, as asked


def test_an_environment_call_past_its_deadline_retires_the_instance(tmp_path, tools_model_dir):
    say = "<tool_call>\n" + json.dumps({"name": "say", "arguments": {"text": "30"}}) + "\n</tool_call>"
    trainer = make_trainer(tmp_path, tools_model_dir, [say + say, "<answer>x</answer>"], reward_funcs=["math_accuracy"],
                           environment_factory=Echo, train_dataset=env_data().add_column("answer", ["1"] * 4),
                           overrides={"task": None, "tool_timeout": 0.2, "max_completion_length": 400})
    probe = trainer.agents.environments.pool[None][0]
    batch = trainer.rollout()
    assert batch.metrics["tools/errors/timeout"] == 8.0  # 4 rows: the slow call, then the environment is unavailable
    pool = trainer.agents.environments.pool[None]
    assert len(pool) == 4 and probe not in pool  # the 4 instances the rows used (the probe among them) replaced


# ---- rollout_func ------------------------------------------------------------------------------------------------
def test_rollout_func_follows_trls_contract(tmp_path, tools_model_dir):
    seen = {}

    def my_rollout(prompts, trainer, seeds):
        seen["seeds"], seen["prompts"] = seeds, prompts
        tok = trainer.tokenizer
        prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completion = tok("ab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return {"prompt_ids": prompt_ids, "completion_ids": [completion] * len(prompts),
                "logprobs": [[-0.5, -1.0, -1.5]] * len(prompts), "env_mask": [[1, 0, 1]] * len(prompts),
                "tag": ["t"] * len(prompts)}

    def tagged(completions, tag, **kwargs):
        return [1.0 if t == "t" and c == "ab" else 0.0 for c, t in zip(completions, tag)]

    trainer = make_trainer(tmp_path, tools_model_dir, ["unused"], rollout_func=my_rollout, reward_funcs=[tagged],
                           overrides={"task": "arithmetic"})
    batch = trainer.rollout()
    assert seen["seeds"] == [row_seed(3, 0, r) for r in range(4)]
    assert seen["prompts"][0] == seen["prompts"][1] != seen["prompts"][2]  # each prompt G times
    assert batch.completion_mask.tolist() == [[1.0, 0.0, 1.0]] * 4
    assert batch.sampling_logp.tolist() == [[-0.5, -1.0, -1.5]] * 4
    assert batch.metrics["reward/tagged"] == 1.0 and batch.metrics["tools/model_token_frac"] == pytest.approx(2 / 3)


def test_rollout_func_output_is_checked(tmp_path, tools_model_dir):
    def short(prompts, trainer):
        return {"prompt_ids": [[1]], "completion_ids": [[1]], "logprobs": None}

    trainer = make_trainer(tmp_path, tools_model_dir, ["x"], rollout_func=short, overrides={"task": "arithmetic"})
    with pytest.raises(ConfigError, match="'completion_ids' has 1 entries for 4 prompts"):
        trainer.rollout()


# ---- configuration -----------------------------------------------------------------------------------------------
def test_settings_that_cannot_work_are_refused_with_the_key(tmp_path, tools_model_dir, tiny_model_dir):
    with pytest.raises(ConfigError, match="^tools: unknown tool 'abacus'"):
        make_trainer(tmp_path, tools_model_dir, ["x"], overrides={"tools": ["abacus"]})
    with pytest.raises(ConfigError, match="^step_reward_funcs: process supervision is not built for multi-turn"):
        make_trainer(tmp_path, tools_model_dir, ["x"], overrides={"step_reward_funcs": ["arithmetic_steps"]})
    with pytest.raises(ConfigError, match="^rollout_func: a rollout function of your own replaces the tool loop"):
        make_trainer(tmp_path, tools_model_dir, ["x"], rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ConfigError, match="^tools: tool calling needs a chat template"):
        make_trainer(tmp_path, tiny_model_dir, ["x"], overrides={"use_chat_template": "auto"})
    with pytest.raises(ConfigError, match="^environment_factory: a dict of environments needs an 'environment'"):
        make_trainer(tmp_path, tools_model_dir, ["x"], environment_factory={"a": Counter}, train_dataset=env_data(),
                     overrides={"task": None})
    # a row naming an environment the factory lacks: TRL's ValueError when a rollout draws it (in train())
    trainer = make_trainer(tmp_path, tools_model_dir, ["x"], environment_factory={"a": Counter},
                           train_dataset=env_data(2, ["a", "unknown"]), overrides={"task": None, "prompts_per_step": 2})
    with pytest.raises(ValueError, match=r"^Example has `environment='unknown'`, which is not among the environments "
                                         r"passed to `environment_factory`. Expected one of: \['a'\]."):
        trainer.rollout()
    for key, value in (("max_tool_calling_iterations", -1), ("tool_timeout", 0), ("max_tool_output_chars", 0)):
        with pytest.raises(ConfigError, match=f"^{key}:"):
            GRPOConfig(**{key: value})


def test_sharded_weights_on_several_processes_are_refused_with_tools():
    from types import SimpleNamespace

    from grpo.agents import make_agent_spec

    fsdp = SimpleNamespace(num_processes=2, distributed_type="FSDP", state=SimpleNamespace())
    zero3 = SimpleNamespace(num_processes=2, distributed_type="DEEPSPEED",
                            state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    for accelerator in (fsdp, zero3):
        with pytest.raises(ConfigError, match="^tools: multi-turn rollouts with sharded weights"):
            make_agent_spec(GRPOConfig(tools=["calculator"]), accelerator=accelerator)
    zero2 = SimpleNamespace(num_processes=2, distributed_type="DEEPSPEED",
                            state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    spec = make_agent_spec(GRPOConfig(tools=["calculator"]), accelerator=zero2)
    assert [t.name for t in spec.tools] == ["calculator"] and "calculator" in spec.describe()
    spec.close()


def test_grpo_eval_runs_the_tool_loop(tmp_path, tools_model_dir):
    from grpo.cli import main

    assert main(["eval", "--model", tools_model_dir, "--task", "calculator", "--n", "4", "--max-completion-length",
                 "32", "--json", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert {"tool_call_rate", "tool_calls", "accuracy"} <= set(result) and len(result["rows"]) == 4


def broken(expression: str) -> str:
    """A calculator that is down.

    Args:
        expression: the arithmetic to do
    """
    raise ConnectionError("calculator service unreachable")


def test_a_tool_failing_on_every_call_raises_the_alarm_once_and_the_run_sums_it_up(tmp_path, tools_model_dir, capsys):
    """Issue 34: a tool that raised (or hung) on every call gave no warning; its errors went only to the model."""
    call = CALL.replace('"calculator"', '"broken"')
    trainer = make_trainer(tmp_path, tools_model_dir, [call, "<answer>42</answer>"], tools=[broken],
                           overrides={"max_steps": 3, "disable_tqdm": False})
    metrics = trainer.train()
    assert metrics["tools/fault_frac"] == 1.0 and metrics["health/tool_faults"] == 1.0
    out = capsys.readouterr().out
    assert out.count("WARNING tool_faults: tools raised or timed out on 100% of their calls over the last steps") == 1
    assert "WARNING  tools raised or timed out on 100% of their calls this run" in out
