"""What TRL users' code reads off GRPOTrainer beyond train() (grpo.training.trl_surface), the TRL keys accepted with
no effect here, TRL's data rules without a train_dataset, and a reward tokenizer whose pad token is not in its
vocabulary. The same facts TRL's own suite checks (scripts/adapt_trl_tests.py; docs/from_trl.md has its counts)."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.training.observe.tracking import read_metrics
from test_trl_surface import a_reward, prompts
from test_trl_surface import config as surface_config


def config(tmp_path, **values):
    return surface_config(tmp_path, **{"max_steps": 3, "save_steps": 0, **values})


def test_the_last_log_entry_is_the_end_of_training_summary(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, logging_steps=2),
                          train_dataset=prompts())
    result = trainer.train()
    last = trainer.state.log_history[-1]
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run")]  # steps 2 and 3 logged (every 2, and the end)
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
            "epoch", "step"} <= set(last)
    assert last["step"] == 3 and last["train_runtime"] > 0
    # 3 steps of 4 completions: samples/s = 12 / runtime, steps/s = 3 / runtime (as transformers rounds them)
    assert last["train_samples_per_second"] == pytest.approx(12 / last["train_runtime"], rel=1e-3)
    assert last["train_steps_per_second"] == pytest.approx(3 / last["train_runtime"], rel=1e-3)
    assert losses[-1] == pytest.approx(trainer.state.log_history[-2]["loss"])
    assert result.training_loss == last["train_loss"] and result.metrics["train_runtime"] == last["train_runtime"]


def test_train_loss_is_the_mean_of_every_steps_loss(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, logging_steps=1),
                          train_dataset=prompts())
    trainer.train()
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 3
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(sum(losses) / 3)


def test_trl_attributes(tiny_model_dir, tmp_path):
    from transformers import TrainerState

    evals = {"a": prompts(4), "b": prompts(4)}
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path), train_dataset=prompts(),
                          eval_dataset=evals)
    assert trainer.args is trainer.cfg and trainer.accelerator is trainer.accel
    assert trainer.eval_dataset is evals and set(trainer.eval_set) == {"a", "b"}
    assert trainer.ref_model is trainer.reference  # beta 0.04 (ours): a reference
    assert trainer.reward_processing_classes == [None] and trainer.aux_loss_enabled is False
    state = TrainerState(global_step=7)
    trainer.state = state
    assert trainer.state is state and trainer.rollouts.trainer_state is state  # (what rewards get)
    no_kl = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, beta=0.0),
                        train_dataset=prompts())
    assert no_kl.ref_model is None and no_kl.eval_dataset is None


def test_evaluate_takes_a_dataset_or_a_dict_of_them(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path), train_dataset=prompts())
    with pytest.raises(ValueError, match="evaluate: no eval_dataset"):
        trainer.evaluate()
    one = trainer.evaluate(eval_dataset=prompts(3))
    assert one["eval_num_prompts"] == 3.0 and one["eval/num_prompts"] == 3.0 and "eval_runtime" in one
    both = trainer.evaluate(eval_dataset={"x": prompts(2), "y": prompts(5)})
    assert (both["eval_x_num_prompts"], both["eval_y_num_prompts"]) == (2.0, 5.0)
    assert (both["eval/x/num_prompts"], both["eval/y/num_prompts"]) == (2.0, 5.0)
    # the same prompts and seed: the same samples, whichever way the set was given
    assert both["eval_x_mean_length"] == trainer.evaluate(eval_dataset=prompts(2))["eval_mean_length"]


def test_get_high_entropy_mask_keeps_the_top_quantile_of_completion_tokens(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path), train_dataset=prompts())
    entropies = torch.tensor([[0.5, 0.1, 0.9], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # 5.0 is padding
    # completion entropies 0.1 0.3 0.5 0.7 0.9; the 0.5 quantile (linear) is 0.5: keep 0.5, 0.7, 0.9
    got = trainer.get_high_entropy_mask(entropies, mask, 0.5)
    assert got.tolist() == [[True, False, True], [False, True, False]]
    # the 0.75 quantile: position 0.75 * 4 = 3 of the sorted five, 0.7: keep 0.7 and 0.9
    assert trainer.get_high_entropy_mask(entropies, mask, 0.75).tolist() == [[False, False, True],
                                                                             [False, True, False]]
    assert not trainer.get_high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()


def test_get_off_policy_mask_drops_negative_advantage_rows_far_from_the_sampler():
    advantages = torch.tensor([[0.5], [-0.5], [-0.5]])
    sampling = torch.zeros(3, 3)
    logp = torch.tensor([[-3.0, -3.0, -3.0], [-0.2, -0.4, 0.0], [-1.0, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # mean KL (sampling - logp over the row's tokens): 3.0 (kept: A >= 0), 0.3 (kept: <= 1), 1.5 (dropped)
    got = GRPOTrainer.get_off_policy_mask(advantages, logp, sampling, mask, 1.0)
    assert got.tolist() == [[1.0], [1.0], [0.0]] and got.dtype == mask.dtype


def test_policy_loss_is_the_loss_without_the_entropy_bonus(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward,
                          args=config(tmp_path, entropy_coef=0.5, max_steps=2), train_dataset=prompts())
    trainer.train()
    for row in read_metrics(tmp_path / "run"):
        # one micro-batch per step: the bonus is 0.5 x the mean token entropy, subtracted from the loss
        assert row["policy_loss"] - row["loss"] == pytest.approx(0.5 * row["entropy"], rel=1e-4)
    assert trainer.entropy_coef == 0.5


def test_trl_warns_of_sequence_level_ratios_with_a_token_summed_loss(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(),
                    args=config(tmp_path, importance_sampling_level="sequence", loss_type="dapo"))
    assert "weights each sequence by its completion length" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(),
                    args=config(tmp_path, importance_sampling_level="sequence", loss_type="grpo"))
    assert "weights each sequence" not in caplog.text


def test_keys_with_no_effect_here_are_accepted_and_bad_values_refused():
    cfg = GRPOConfig(dataloader_num_workers=4, accelerator_config={"dispatch_batches": True}, pad_to_multiple_of=8,
                     use_transformers_continuous_batching=True, dataloader_persistent_workers=True)
    assert (cfg.dataloader_num_workers, cfg.pad_to_multiple_of) == (4, 8) and cfg.use_transformers_continuous_batching
    with pytest.raises(ConfigError, match="dataloader_num_workers: -1 must be a count >= 0"):
        GRPOConfig(dataloader_num_workers=-1)
    with pytest.raises(ConfigError, match="accelerator_config: .*use_configured_state set: not supported"):
        GRPOConfig(accelerator_config={"use_configured_state": True})
    with pytest.raises(ConfigError, match="pad_to_multiple_of: 0 must be a positive integer"):
        GRPOConfig(pad_to_multiple_of=0)


def test_a_trl_config_with_those_keys_trains(tiny_model_dir, tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, num_generations=4,
                          per_device_train_batch_size=4, max_completion_length=6, max_steps=1, report_to="none",
                          dataloader_num_workers=2, pad_to_multiple_of=8, epsilon=10.0, save_strategy="no")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=args, train_dataset=prompts())
    metrics = trainer.train()
    # epsilon 10: the lower clip bound 1 - 10 < 0 never binds (ratios are > 0); the loss is finite
    assert metrics["policy/clip_frac_low"] == 0.0 and torch.isfinite(torch.tensor(metrics["train/loss"]))


# ---- no train_dataset: TRL's rules -------------------------------------------------------------------------------
class Guess:
    def reset(self, **row):
        return "Guess the word."

    def guess(self, word: str) -> str:
        """Guess a word.

        Args:
            word: the guess
        """
        return "no"


def test_rewards_without_a_dataset_raise_trls_error_not_the_task(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory`"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path))
    # a config alone (what `grpo train` builds with no dataset) trains on its task, as before
    trainer = GRPOTrainer(model=tiny_model_dir, args=config(tmp_path, task_train_size=8))
    assert trainer.task is not None and trainer.task.name == "arithmetic"
    # and so does a task named explicitly, whatever else is given
    named = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, task="arithmetic",
                                                                                 task_train_size=8))
    assert named.task is not None and named.reward_names == ["a_reward"]


def test_environments_without_a_dataset(tools_model_dir, tmp_path):
    with pytest.raises(ValueError, match="max_steps: when training without a `train_dataset`"):
        GRPOTrainer(model=tools_model_dir, reward_funcs=a_reward, environment_factory=Guess,
                    args=config(tmp_path, max_steps=-1, max_completion_length=40))
    with pytest.raises(ValueError, match="A `dict` `environment_factory` .* requires a `train_dataset`"):
        GRPOTrainer(model=tools_model_dir, reward_funcs=a_reward, environment_factory={"a": Guess, "b": Guess},
                    args=config(tmp_path, max_completion_length=40))
    trainer = GRPOTrainer(model=tools_model_dir, reward_funcs=a_reward, environment_factory=Guess,
                          args=config(tmp_path, max_completion_length=40))
    assert trainer.task is None and trainer.reward_names == ["a_reward"]
    batch = trainer.rollout()
    texts = trainer.tokenizer.batch_decode(batch.input_ids[:, :-batch.completion_width], skip_special_tokens=True)
    assert all(t.endswith("user\nGuess the word.\nassistant\n") for t in texts)  # the prompt is reset()'s text


def test_a_dataset_of_environments_only_takes_its_prompts_from_reset(tools_model_dir, tmp_path):
    data = Dataset.from_dict({"environment": ["a", "b", "a", "b"]})
    trainer = GRPOTrainer(model=tools_model_dir, reward_funcs=a_reward, environment_factory={"a": Guess, "b": Guess},
                          train_dataset=data, args=config(tmp_path, max_completion_length=40))
    batch = trainer.rollout()
    texts = trainer.tokenizer.batch_decode(batch.input_ids[:, :-batch.completion_width], skip_special_tokens=True)
    assert all(t.endswith("user\nGuess the word.\nassistant\n") for t in texts)


def test_a_reward_tokenizer_whose_pad_token_is_not_in_its_vocabulary(tiny_model_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    from grpo.rewards.reward_model import RewardModel

    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=258, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1, num_labels=1))
    plain = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)  # (a token it lacks has no id)
    added = AutoTokenizer.from_pretrained(tiny_model_dir)  # (Qwen2's class adds it: an id past the embeddings)
    for tokenizer in (plain, added):
        tokenizer.pad_token = "<|finetune_right_pad_id|>"  # (TRL's test sets Llama's; this vocabulary lacks it)
        assert tokenizer.pad_token_id is None or tokenizer.pad_token_id >= 258
        reward = RewardModel(model, tokenizer=tokenizer)
        together = reward(["ab", "ab", "x"], ["c", "cdef", "ab"])  # rows of 3, 6 and 3 tokens, padded in one batch
        alone = [reward([p], [c])[0] for p, c in (("ab", "c"), ("ab", "cdef"), ("x", "ab"))]
        assert together == pytest.approx(alone, abs=1e-6)
        assert len(set(round(v, 6) for v in together)) == 3


@pytest.mark.parametrize("loss_type, want", [
    # two samples per prompt, "aa<eos>" (3 tokens, reward 2) then "b<eos>" (2 tokens, reward 0): advantages
    # +-1 / (std sqrt(2) + 1e-4) = +-0.70706. At ratio 1 each token's surrogate is -A.
    ("dapo", -0.70706 * (3 - 2) / 5),  # token mean over the batch: -(3 A - 2 A) / 5 per prompt pair
    ("grpo", 0.0),  # mean of the sequences' means: -(A - A) / 2
])
@pytest.mark.parametrize("eval_batch", [256, 2])  # 2: the eval batch in 3 chunks, each its reference pass
def test_evaluate_reports_trls_eval_loss(tiny_model_dir, tmp_path, loss_type, want, eval_batch):
    from transformers import AutoTokenizer

    from grpo.engines.base import ScriptedGenerator

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = []

    def complete(ids, rng):
        calls.append(1)
        return tok("aa" if len(calls) % 2 else "b", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(),
                          args=config(tmp_path, num_generations=2, per_device_train_batch_size=2,
                                      loss_type=loss_type, beta=0.04, per_device_eval_batch_size=eval_batch),
                          generator=ScriptedGenerator(complete, [tok.eos_token_id]))
    out = trainer.evaluate(eval_dataset=prompts(3))
    # beta 0.04: the reference is the untrained policy, so the KL term is 0
    assert out["eval_loss"] == pytest.approx(want, abs=1e-4) and out["eval/loss"] == out["eval_loss"]
    assert "eval/loss" not in trainer.evaluate(eval_dataset=prompts(3), loss=False)
