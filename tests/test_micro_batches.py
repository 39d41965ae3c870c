"""Micro-batches (grpo/training/update/micro_batches.py) and padding-free training: the cuts by hand, and the trainer's
gradients, losses and weights with packed passes against padded ones (every loss aggregation, two iterations, a KL
term, both engines, LoRA) and with token-budget micro-batches against one batch."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.engines.base import ScriptedGenerator
from grpo.engines.packing import Packing
from grpo.training.update.micro_batches import MicroBatches
from grpo.training.rollout.batch import RolloutBatch, pack


class OneProcess:
    world = 1


def batch_of(prompts, completions):
    ids, attention, mask = pack(prompts, completions, 1, [True] * len(prompts))
    return RolloutBatch(ids, attention, mask, torch.zeros(len(prompts)))


# Prompts [5 6 7] x 2 and [8 9] x 2; completions of 4, 2, 5 and 1 tokens. With shared prompts a row costs its
# completion less its last token, plus its prompt the first time it appears in a micro-batch:
# rows 0..3 cost 3+3, 0+1, 2+4, 0+0 (a micro-batch of rows 1 and 2 alone: 3+1 and 2+4).
BATCH = ([[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]], [[1, 2, 3, 4], [1, 2], [1, 2, 3, 4, 5], [1]])


def span(plan):
    """(first row, last row + 1) of a micro-batch of consecutive rows."""
    rows = plan.rows.tolist()
    assert rows == list(range(rows[0], rows[-1] + 1))
    return rows[0], rows[-1] + 1


def cuts(planner, batch, rows=None):
    return [(*span(p), p.tokens) for p in planner.plan(batch, rows)]


def test_token_budget_cuts_by_hand():
    batch = batch_of(*BATCH)
    shared = Packing(True, "bool", None)
    assert cuts(MicroBatches(2, None, shared, OneProcess()), batch) == [(0, 2, 7), (2, 4, 6)]
    assert cuts(MicroBatches(64, 7, shared, OneProcess()), batch) == [(0, 2, 7), (2, 4, 6)]
    assert cuts(MicroBatches(64, 6, shared, OneProcess()), batch) == [(0, 1, 6), (1, 2, 4), (2, 4, 6)]
    assert cuts(MicroBatches(64, 1, shared, OneProcess()), batch) == [(0, 1, 6), (1, 2, 4), (2, 3, 6), (3, 4, 2)]
    assert cuts(MicroBatches(64, 7, shared, OneProcess()), batch, torch.arange(1, 4)) == [(1, 2, 4), (2, 4, 6)]
    # A step's rows in the order they come (a shuffled slice of the rollout), 3 0 1 2: row 3 first pays its prompt,
    # 2+0; with row 0 (3+3) that is 8 > 7, so 3 alone; rows 0 and 1 share [5 6 7]: 6 + 0+1 = 7; row 2 alone, 2+4.
    got = [(p.rows.tolist(), p.tokens) for p in MicroBatches(64, 7, shared, OneProcess()).plan(batch, torch.tensor(
        [3, 0, 1, 2]))]
    assert got == [([3], 2), ([0, 1], 7), ([2], 6)]
    # Whole sequences: every row pays its prompt (rows 0..3: 6, 4, 6, 2).
    assert cuts(MicroBatches(64, 10, Packing(False, None, 1e-3), OneProcess()), batch) == [(0, 2, 10), (2, 4, 8)]
    # Padded: rows x (prompt width 3 + the micro-batch's completion width - 1): rows 0-1 2 x 6, rows 2-3 2 x 7.
    assert cuts(MicroBatches(64, 14, None, OneProcess()), batch) == [(0, 2, 12), (2, 4, 14)]
    assert cuts(MicroBatches(64, 13, None, OneProcess()), batch) == [(0, 2, 12), (2, 3, 7), (3, 4, 3)]


def test_under_sequence_parallel_the_budget_is_per_process():
    """Whole sequences in one row (the layout SP splits): rows 0..3 cost 6, 4, 6, 2. A budget of 5 tokens on one
    process: rows 0 and 2 exceed it and go alone (over the budget), and no two rows fit together. With SP=2 each
    process holds half of a micro-batch's tokens (ceil(C / 2) <= 5 exactly when C <= 10): rows 0 and 1 go together
    (10 tokens, 5 on each process), then rows 2 and 3 (8, 4 on each)."""
    batch, whole = batch_of(*BATCH), Packing(False, None, None)
    assert cuts(MicroBatches(64, 5, whole, OneProcess()), batch) == [(0, 1, 6), (1, 2, 4), (2, 3, 6), (3, 4, 2)]
    split = MicroBatches(64, 5, whole, OneProcess(), split=2)
    assert cuts(split, batch) == [(0, 2, 10), (2, 4, 8)]
    assert split.describe().endswith("micro-batches of up to 5 tokens per process (10 over the 2 that share one)")
    # Without a budget SP changes nothing: per_device_train_batch_size rows.
    assert cuts(MicroBatches(3, None, whole, OneProcess(), split=2), batch) == [(0, 3, 16), (3, 4, 2)]


def test_every_process_runs_as_many_micro_batches_as_the_one_that_needs_most():
    """Another process needs 4 micro-batches, this one 2 by its budget: it cuts its rows into 4, the largest as small
    as contiguous cuts allow."""
    class TwoProcesses:
        world = 2

        def gather(self, t):
            return torch.cat([t, torch.tensor([4])])

    plans = MicroBatches(64, 7, Packing(True, "bool", None), TwoProcesses()).plan(batch_of(*BATCH))
    assert [span(p) for p in plans] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_the_token_budget_is_a_config_key_with_verls_name_as_alias():
    assert GRPOConfig.from_dict({"ppo_max_token_len_per_gpu": 4096}).max_tokens_per_micro_batch == 4096
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch: must be >= 1 tokens"):
        GRPOConfig(max_tokens_per_micro_batch=0)


def length_reward(completions, **kwargs):
    return [len(c) / 8 for c in completions]


def scripted(tokenizer, longest=12):
    """Completions of 1 to `longest` tokens drawn from the row's seed (ragged, as real ones are): every run trains on
    the same rows."""
    def complete(prompt_ids, rng):
        n = int(torch.randint(0, longest, (1,), generator=rng))
        return torch.randint(2, 60, (n,), generator=rng).tolist() + [tokenizer.eos_token_id]
    return ScriptedGenerator(complete, [tokenizer.eos_token_id])


def train(model_dir, tmp_path, own_sampler=False, steps=2, **overrides):
    """Train `steps` steps on scripted completions (or the engine's own sampler); returns (the gradients before each
    optimizer step, the last metrics, the weights, the trainer).

    The trained weights are first moved off the reference by seeded noise, so the KL term and its gradient are far
    from 0; the learning rate is small (1e-6), so that Adam, which turns float32 rounding in a near-zero gradient into
    a step of the full learning rate, leaves two runs' weights within ~1e-6 and later gradients comparable at 1e-5."""
    from transformers import AutoTokenizer

    values = dict(output_dir=str(tmp_path / "run"), task=None, num_generations=4, prompts_per_step=3,
                  max_completion_length=12, learning_rate=1e-6, beta=0.5, max_steps=steps, save_steps=0,
                  report_to=[], log_completions_steps=0, seed=0, per_device_train_batch_size=5, num_iterations=2)
    values.update(overrides)
    tok = AutoTokenizer.from_pretrained(model_dir)
    t = GRPOTrainer(model=model_dir, reward_funcs=[length_reward], args=GRPOConfig(**values),
                    train_dataset=Dataset.from_dict({"prompt": [f"question {i}\n" * (1 + i % 3) for i in range(12)]}),
                    generator=None if own_sampler else scripted(tok))
    noise = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in t.policy.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=noise))
    grads, step = [], t._optimizer_step

    def optimizer_step(batch):
        grads.append({n: p.grad.clone() for n, p in t.policy.named_parameters() if p.grad is not None})
        return step(batch)

    t._optimizer_step = optimizer_step
    metrics = t.train()
    return grads, metrics, {k: v.clone() for k, v in t.policy.state_dict().items()}, t


def assert_same_training(a, b):
    """Equal gradients at every optimizer step (each within 1e-5 of its largest entry), loss metrics and weights."""
    (grads_a, metrics_a, weights_a, _), (grads_b, metrics_b, weights_b, _) = a, b
    assert len(grads_a) == len(grads_b) > 0
    for step_a, step_b in zip(grads_a, grads_b):
        assert step_a.keys() == step_b.keys()
        for name in step_a:
            scale = float(step_b[name].abs().max())
            torch.testing.assert_close(step_a[name], step_b[name], atol=1e-5 * scale + 1e-9, rtol=1e-4, msg=name)
    assert metrics_a["policy/kl_divergence"] > 1e-3  # the reference pass matters
    for key in ("policy/loss", "policy/kl_divergence", "policy/entropy", "policy/ratio_mean", "train/grad_norm"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-5, abs=1e-7), key
    diff = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    assert diff < 1e-5, diff  # each of 2 x steps Adam updates moves a weight by at most ~1e-6


@pytest.mark.parametrize("engine", ["cpu", "transformers"])
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_padding_free_training_is_the_padded_training(tiny_model_dir, tmp_path, engine, aggregation):
    """Packed passes (shared prompts, rows sized by cost) and padded ones: the same gradients in both iterations of
    every step (the second iteration's ratios use the first's log-probs), the same KL to the reference pass's
    log-probs, losses and weights, for each aggregation and both engines; the passes computed fewer positions."""
    runs = [train(tiny_model_dir, tmp_path / str(pad), engine=engine, loss_aggregation=aggregation,
                  use_remove_padding=pad) for pad in (True, False)]
    trainer = runs[0][3]
    assert trainer.micro.packing.shared_prompts and runs[1][3].micro.packing is None
    plans = trainer.micro.plan(trainer.rollout())
    assert sum(p.packed.tokens for p in plans) < sum(p.tokens for p in runs[1][3].micro.plan(trainer.rollout()))
    assert_same_training(*runs)


@pytest.mark.parametrize("overrides", [
    # two optimizer steps per rollout pass (generation_batch_size 24 = 2 x 12): shuffled slices, old log-probs from
    # a scoring pass; TRL's bnpo normalizes by each micro-batch's tokens
    dict(loss_type="bnpo", generation_batch_size=24),
    dict(loss_type="cispo", top_entropy_quantile=0.5),  # the high-entropy token mask (a quantile over every token)
    dict(loss_type="sapo", entropy_coef=0.05),  # the entropy bonus: its gradient through the packed entropies
    dict(loss_type="luspo", delta=1.5, off_policy_mask_threshold=0.01, importance_sampling_level="sequence"),
])
def test_padding_free_training_is_the_padded_training_for_trls_losses(tiny_model_dir, tmp_path, overrides):
    """TRL's loss family on packed rows: the same gradients, losses and weights as on padded ones."""
    runs = [train(tiny_model_dir, tmp_path / str(pad), use_remove_padding=pad, **overrides) for pad in (True, False)]
    assert runs[0][3].micro.packing is not None and runs[1][3].micro.packing is None
    assert_same_training(*runs)


def test_padding_free_training_with_lora_is_the_padded_training(tiny_model_dir, tmp_path):
    """With LoRA the reference is the policy with its adapters off, and the frozen head takes the one-pass loss's
    buffer: packed and padded passes give the same adapter gradients and weights, under gradient checkpointing."""
    pytest.importorskip("peft")
    runs = [train(tiny_model_dir, tmp_path / str(pad), use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                  lora_target_modules=["q_proj", "v_proj", "up_proj"], gradient_checkpointing=True,
                  use_remove_padding=pad)
            for pad in (True, False)]
    assert all(".lora_" in name for name in runs[0][0][0])
    assert_same_training(*runs)


def test_padding_free_seeded_one_pass_loss_is_the_padded_one(tiny_model_dir, tmp_path, monkeypatch):
    """The CPU engine's one-pass loss seeded by its own sampler's log-probs (as with a large vocabulary, whose rows
    do not fit the buffer) on packed rows: the gradients of the first update equal the padded path's."""
    import grpo.engines.cpu.backend as backend

    monkeypatch.setattr(backend, "_FUSED_ELEMENTS", 1)
    seeded = []
    hidden_loss = backend.hidden_loss
    monkeypatch.setattr(backend, "hidden_loss", lambda *a, **kw: seeded.append(kw["logp_estimate"] is not None)
                        or hidden_loss(*a, **kw))
    runs = [train(tiny_model_dir, tmp_path / str(pad), own_sampler=True, steps=1, use_remove_padding=pad)
            for pad in (True, False)]
    assert seeded[:3] == [True, True, True]  # the first iteration's micro-batches, packed run
    assert_same_training(*runs)


def test_token_budget_micro_batches_give_the_one_batch_training(tiny_model_dir, tmp_path):
    """Micro-batches filled to 40 tokens (several per step, of different row counts) train as one batch of all 12
    rows: the step's normalizers are global, so the sum of the shares is the one-batch loss."""
    one = train(tiny_model_dir, tmp_path / "one", per_device_train_batch_size=12, loss_aggregation="token_mean")
    budget = train(tiny_model_dir, tmp_path / "budget", per_device_train_batch_size=12, loss_aggregation="token_mean",
                   max_tokens_per_micro_batch=40)
    plans = budget[3].micro.plan(budget[3].rollout())
    assert len(plans) >= 3 and len({len(p) for p in plans}) > 1
    assert all(p.tokens <= 40 or len(p) == 1 for p in plans)
    assert_same_training(budget, one)
