"""End-to-end: the trainer learns on a tiny model built in a fixture, saves a loadable model, resumes, and the seed
recipes run. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from rewards_for_tests import count_a


def prompts(n=16):
    return Dataset.from_dict({"prompt": [f"q{i % 10}\n" for i in range(n)]})


def base_config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), task=None, dataset_name=None, num_generations=8,
                  prompts_per_step=4, max_completion_length=8, learning_rate=1e-2, beta=0.0, max_steps=20,
                  save_steps=0, report_to=[], log_completions_steps=0, seed=0, task_eval_size=0)
    values.update(overrides)
    return GRPOConfig(**values)


def rewards_of(run_dir):
    return [row["reward/total"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "reward/total" in row]


def test_reward_rises_on_a_learnable_reward(tiny_model_dir, tmp_path):
    cfg = base_config(tmp_path, learning_rate=2e-2)  # measured: mean reward 0.01 -> 1.0 by step 16
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
    trainer.train()
    r = rewards_of(tmp_path / "run")
    assert len(r) == 20
    first, last = sum(r[:3]) / 3, sum(r[-3:]) / 3
    # A random 258-token vocabulary gives ~1/258 "a"; learning must lift it by a clear margin, not noise.
    assert first < 0.15 and last > first + 0.3, (r[:3], r[-3:])


def test_final_model_reloads_and_generates(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = base_config(tmp_path, max_steps=2)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts()).train()
    final = tmp_path / "run" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    out = model.generate(**tok(["q1\n"], return_tensors="pt"), max_new_tokens=5, do_sample=True)
    assert out.shape[1] > 3
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "plot.png").exists()


def test_micro_batches_match_one_big_batch(tiny_model_dir, tmp_path):
    """Gradient accumulation is exact: 4 micro-batches of 8 give the weights of one batch of 32."""
    finals = []
    for i, size in enumerate((32, 8)):
        for agg in ("sequence_mean",):
            cfg = base_config(tmp_path / f"{i}", max_steps=3, per_device_train_batch_size=size,
                              loss_aggregation=agg)
            t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
            t.train()
            finals.append({k: v.clone() for k, v in t.policy.state_dict().items()})
    diff = max((finals[0][k] - finals[1][k]).abs().max().item() for k in finals[0])
    # Padding-free rows are laid out per micro-batch, so the two round differently (measured 1.1e-5; padded rows
    # 1.4e-6), and Adam at lr 1e-2 turns rounding in a near-zero gradient into a step of up to 1e-2. The gradients
    # themselves agree to ~1e-6 (tests/test_micro_batches.py compares them).
    assert diff < 1e-4, diff


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("one_pass", ["seeded", "buffer"])
def test_one_pass_loss_gradient_matches_the_two_pass_path(tiny_model_dir, tmp_path, ratio_level, one_pass,
                                                          monkeypatch):
    """hidden_loss (the loss's gradient formed in the log-prob pass), seeded by the sampler's log-probs in the first
    iteration or through its row buffer, trains to the same weights and metrics as hidden_logprobs + backward, with
    the KL term, 2 iterations and 2 micro-batches of ragged completions."""
    import grpo.engines.cpu.backend as model_module

    seeded = []
    if one_pass == "seeded":  # as with a real vocabulary: the buffer cannot hold a row, so no buffer path
        monkeypatch.setattr(model_module, "_FUSED_ELEMENTS", 1)
    hidden_loss = model_module.hidden_loss
    monkeypatch.setattr(model_module, "hidden_loss", lambda *a, **kw: seeded.append(
        kw["logp_estimate"] is not None) or hidden_loss(*a, **kw))
    runs = []
    for fused in (True, False):
        cfg = base_config(tmp_path / str(fused), max_steps=6, beta=0.04, num_iterations=2,  # 3 rollouts
                          per_device_train_batch_size=16, importance_sampling_level=ratio_level,
                          loss_aggregation="sequence_mean")
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
        assert t.backend.fused_loss and t.backend.sampling_estimates
        t.backend.fused_loss, t.backend.sampling_estimates = fused, one_pass == "seeded"
        metrics = t.train()
        runs.append(({k: v.clone() for k, v in t.policy.state_dict().items()}, metrics))
    # the first iteration's passes seeded (the trained head's second iteration has no estimate and takes the two
    # passes), or every pass through the buffer
    assert seeded == ([True, True] * 3 if one_pass == "seeded" else [False] * 12)
    diff = max((runs[0][0][k] - runs[1][0][k]).abs().max().item() for k in runs[0][0])
    assert diff < 1e-4, diff  # float rounding order only: lr 1e-2 moves weights ~1e-2 per step
    for key in ("policy/loss", "policy/kl_divergence", "policy/clip_frac", "policy/entropy", "train/grad_norm"):
        assert runs[0][1][key] == pytest.approx(runs[1][1][key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("iterations", [1, 2])
def test_head_gradient_memory_is_lent_to_the_next_rollouts_packed_head(tiny_model_dir, tmp_path, monkeypatch,
                                                                       iterations):
    """On one thread with the compiled head, the memory of the head's gradient is handed to the next rollout, which
    packs the head into it and lets it go (or to the next iteration's gradient, which takes it back); training gives
    the same weights, bit for bit, as without it (2 micro-batches, KL term; buffer, seeded and two-pass updates)."""
    import grpo.engines.cpu.backend as model_module
    from grpo.engines.cpu import decoding, native
    from grpo.engines.policy import plain_head

    if native.library() is None or not native.library().lean_wide_vectors():
        pytest.skip("no C compiler, or a CPU without AVX-512: sampling takes oneDNN's head, no compiled one to pack")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(decoding, "_SMALL_HEAD", 0)  # the tiny model's head is small enough to take as it is
    packed, grads, lent = [], [], []
    init = native.CompiledHead.__init__
    monkeypatch.setattr(native.CompiledHead, "__init__",
                        lambda self, *a, **kw: init(self, *a, **kw) or packed.append(self.packed.data_ptr()))
    runs = []
    for lend in (True, False):
        cfg = base_config(tmp_path / str(lend), max_steps=3, beta=0.04, per_device_train_batch_size=16,
                          num_iterations=iterations)
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
        assert t.backend.lend_head_grad
        t.backend.lend_head_grad = lend
        step = t._optimizer_step

        def optimizer_step(batch, t=t, step=step):
            grads.append(plain_head(t.policy).weight.grad.data_ptr())
            norm = step(batch)
            lent.append(None if t.generator.head_space is None else t.generator.head_space.data_ptr())
            return norm

        t._optimizer_step = optimizer_step
        for i in range(3 * iterations):  # the first rollout through the row buffer; then seeded (a second
            # iteration: two passes); one optimizer step per call
            monkeypatch.setattr(model_module, "_FUSED_ELEMENTS", 10**9 if i < iterations else 1)
            t.train_step()
            t.step += 1
        runs.append({k: v.clone() for k, v in t.policy.state_dict().items()})
        if not lend:
            assert lent == [None] * len(lent)
        elif iterations == 1:  # each rollout after the first packs into the gradient of the step before
            assert lent == grads and len(packed) == 3 and packed[1:] == grads[:2]
        else:  # the second iteration takes back the first one's; a two-pass iteration makes its own, lends none
            assert grads[1] == grads[0] == lent[0] == lent[1] == packed[1]
            assert lent[2] == grads[2] and lent[3] is None and lent[5] is None
        if lend:
            t.generator.head_space = torch.zeros(native.packed_floats(native.library(), plain_head(t.policy).weight))
            t.generator.generate([[1, 2]], t.params, [0])
            assert t.generator.head_space is None  # released when the rollout is done
            packed.clear(), grads.clear(), lent.clear()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_fused_decoder_ops_train_like_the_modules(tiny_model_dir, tmp_path, monkeypatch):
    """On the CPU the policy's and the reference's MLP activations and RMSNorms run as compiled passes
    (grpo/engines/cpu/fused.py); training gives the weights and metrics of transformers' own modules up to rounding."""
    import grpo.engines.cpu.backend as trainer_module
    from grpo.engines.cpu import native

    if native.library() is None:
        pytest.skip("no C compiler: nothing is fused")
    runs = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(trainer_module, "fuse_decoder_ops", lambda model: 0)
        cfg = base_config(tmp_path / str(fuse), max_steps=3, beta=0.04, per_device_train_batch_size=16)
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
        for model in (t.policy, t.reference.module):
            assert ("_grpo_unfused_forward" in vars(model.get_decoder().norm)) == fuse
        metrics = t.train()
        runs.append(({k: v.clone() for k, v in t.policy.state_dict().items()}, metrics))
    diff = max((runs[0][0][k] - runs[1][0][k]).abs().max().item() for k in runs[0][0])
    assert diff < 1e-4, diff  # float rounding order only: lr 1e-2 moves weights ~1e-2 per step
    for key in ("policy/loss", "policy/kl_divergence", "policy/entropy", "train/grad_norm"):
        assert runs[0][1][key] == pytest.approx(runs[1][1][key], rel=1e-4, abs=1e-6), key


def test_a_head_that_is_not_a_plain_linear_layer_trains_through_the_full_forward(tiny_model_dir, tmp_path):
    """A config that scales the logits after the head (logit_scale) takes the model's own forward for the update:
    no tiled head, no head-gradient memory to lend, one step trains."""
    import json
    import shutil

    from grpo.engines.policy import plain_head

    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "logit_scale": 0.5}))
    t = GRPOTrainer(model=str(model_dir), reward_funcs=[count_a], args=base_config(tmp_path, max_steps=1, beta=0.04),
                    train_dataset=prompts())
    assert plain_head(t.policy) is None and t.backend.fused_loss and not t.backend.lend_head_grad
    metrics = t.train_step()
    assert torch.isfinite(torch.tensor(metrics["policy/loss"]))


def test_reference_on_disk_trains_like_the_reference_in_memory(tiny_model_dir, tmp_path):
    """reference_weights=disk gives the same KL, loss and weights as a reference held in memory, holds no reference
    weights between passes, and deletes its file when the trainer goes."""
    import gc

    from grpo.engines.cpu.reference import DiskReference

    runs = []
    for where in ("memory", "disk"):
        cfg = base_config(tmp_path / where, max_steps=3, beta=0.5, reference_weights=where)
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
        metrics = t.train()
        runs.append(({k: v.clone() for k, v in t.policy.state_dict().items()}, metrics))
        if where == "disk":
            assert isinstance(t.reference, DiskReference)
            assert all(p.numel() == 0 for p in t.reference.module.parameters())
            path = t.reference.path
            assert path.exists() and path.parent == tmp_path / where / "run"
            del t
            gc.collect()
            assert not path.exists()
    assert runs[0][1]["policy/kl_divergence"] > 1e-4  # the reference matters: the KL term has moved
    # Equal up to matmul rounding (the mapped weights may sit at another memory alignment than the in-memory copy).
    for k in runs[0][0]:
        torch.testing.assert_close(runs[0][0][k], runs[1][0][k], rtol=1e-6, atol=1e-7, msg=k)
    for key in ("policy/loss", "policy/kl_divergence"):
        assert runs[0][1][key] == pytest.approx(runs[1][1][key], rel=1e-5), key


def test_disk_reference_scores_like_the_model_and_keeps_tied_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo.engines.cpu.reference import DiskReference

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 9, 40, 41, 7]])
    want = model(ids).logits
    ref = DiskReference(model, tmp_path)
    model.model.embed_tokens.weight.data.add_(1.0)  # training the policy must not move the reference
    assert ref.module.lm_head.weight is ref.module.model.embed_tokens.weight
    with ref.loaded() as m:
        assert not any(p.requires_grad for p in m.parameters())
        torch.testing.assert_close(m(ids).logits, want, rtol=1e-6, atol=1e-6)
    assert all(p.numel() == 0 for p in ref.module.parameters())
    assert ref.path.exists()
    ref.close()
    assert not ref.path.exists() and not list(tmp_path.iterdir())


def test_disk_references_in_one_directory_keep_their_own_files(tmp_path):
    """Two trainers on one output_dir: each reference scores with its own weights, closing one leaves the other
    intact, and a file left by a process that no longer runs is deleted when the next reference is made."""
    from grpo.engines.cpu.reference import DiskReference

    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref_a, ref_b = DiskReference(a, tmp_path), DiskReference(b, tmp_path)
    assert ref_a.path != ref_b.path
    ref_a.close()
    with ref_b.loaded() as m:
        assert torch.equal(m.weight, b.weight)
    orphan = tmp_path / ".reference-999999999-deadbeef.safetensors"  # no such process
    orphan.write_bytes(b"left by a crash")
    ref_c = DiskReference(a, tmp_path)
    assert not orphan.exists() and ref_b.path.exists() and ref_c.path.exists()


def test_disk_reference_saves_parameters_that_share_memory(tmp_path):
    """Parameters that are one tensor under two objects, or overlapping parts of one storage (which safetensors
    refuses to write as they are), are written and restored."""
    from grpo.engines.cpu.reference import DiskReference

    model = torch.nn.Module()
    flat = torch.arange(12.0)
    model.a = torch.nn.Parameter(flat[:6].view(2, 3))
    model.b = torch.nn.Parameter(flat[4:10].view(3, 2))  # overlaps a's storage
    model.c = torch.nn.Parameter(model.a.data)  # the same tensor as a, another Parameter object
    model.d = torch.nn.Parameter(flat[:6].view(3, 2).t())  # overlaps too, and is not contiguous
    ref = DiskReference(model, tmp_path)
    assert ref.aliases == {"c": "a"}
    with ref.loaded() as m:
        assert torch.equal(m.a, flat[:6].view(2, 3)) and torch.equal(m.b, flat[4:10].view(3, 2))
        assert torch.equal(m.c, m.a) and torch.equal(m.d, flat[:6].view(3, 2).t())


@pytest.mark.parametrize("aggregation", ["token_mean", "constant"])
def test_other_aggregations_and_kl_train(tiny_model_dir, tmp_path, aggregation):
    cfg = base_config(tmp_path, max_steps=3, loss_aggregation=aggregation, beta=0.04, num_iterations=2,
                      importance_sampling_level="sequence")
    metrics = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts()).train()
    assert metrics["policy/kl_divergence"] >= 0 and torch.isfinite(torch.tensor(metrics["policy/loss"]))


def test_lora_trains_adapters_and_exports_merged(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = base_config(tmp_path, max_steps=3, use_peft=True, lora_r=4, lora_alpha=8, beta=0.04,
                      lora_target_modules=["q_proj", "v_proj"])
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
    assert t.reference is None  # the base with adapters off is the reference
    t.train()
    final = tmp_path / "run" / "final"
    assert (final / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(final)

    # TRL's habit: save_model(output_dir), then PeftModel.from_pretrained(base, output_dir) (the adapter there)
    from peft import PeftModel

    out = tmp_path / "saved"
    t.save_model(str(out))
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    trained = {k: v for k, v in t.policy.state_dict().items() if "lora_" in k}
    assert trained and all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())
    for k, v in loaded.merge_and_unload().state_dict().items():  # peft's merge of the same tensors as final/'s
        assert torch.equal(v, merged.state_dict()[k]), k


def test_lora_frozen_head_seeded_in_every_iteration_matches_the_two_pass_path(tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """A frozen head (LoRA) takes the seeded one-pass loss in both iterations (the sampler's log-probs, then the
    first iteration's), with LoRA dropout on, and trains the adapters as the two-pass path does."""
    import grpo.engines.cpu.backend as model_module

    monkeypatch.setattr(model_module, "_FUSED_ELEMENTS_FROZEN_HEAD", 1)  # as with a real vocabulary: no buffer
    seeded = []
    hidden_loss = model_module.hidden_loss
    monkeypatch.setattr(model_module, "hidden_loss", lambda *a, **kw: seeded.append(
        kw["logp_estimate"] is not None) or hidden_loss(*a, **kw))
    runs = []
    for fused in (True, False):
        cfg = base_config(tmp_path / str(fused), max_steps=4, use_peft=True, lora_r=4, lora_alpha=8, beta=0.04,
                          lora_dropout=0.1, num_iterations=2, per_device_train_batch_size=16)  # 2 rollouts
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
        assert t.backend.frozen_head and t.backend.sampling_estimates
        t.backend.fused_loss = fused
        torch.manual_seed(0)  # the same dropout masks on both paths
        t.train()
        runs.append({k: v.clone() for k, v in t.policy.state_dict().items() if "lora" in k})
    assert seeded == [True] * 8  # 2 steps x 2 iterations x 2 micro-batches
    diff = max((runs[0][k] - runs[1][k]).abs().max().item() for k in runs[0])
    assert diff < 1e-4, diff


def test_lora_reference_with_gradient_checkpointing_scores_shared_prompts(tiny_model_dir, tmp_path, monkeypatch):
    """The LoRA reference is the policy in training mode with adapters off, under gradient checkpointing. Whether
    the model keeps the KV cache there depends on the transformers release (5.23 declined it, 5.24 keeps it without
    gradients): either way the reference pass's hidden states equal the full forward's."""
    import grpo.engines.policy as model_module

    checked = []
    shared_hidden = model_module._shared_prompt_hidden

    def compare(model, input_ids, attention_mask, completion_len):
        shared = shared_hidden(model, input_ids, attention_mask, completion_len)
        full = model.get_decoder()(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                                   position_ids=model_module.position_ids(attention_mask)[:, :-1],
                                   use_cache=False).last_hidden_state[:, -completion_len:]
        checked.append(None if shared is None else float((shared - full).abs().max()))
        return shared

    monkeypatch.setattr(model_module, "_shared_prompt_hidden", compare)
    cfg = base_config(tmp_path, max_steps=1, prompts_per_step=2, use_peft=True, lora_r=4, lora_alpha=8, beta=0.04,
                      gradient_checkpointing=True, use_remove_padding=False)  # (the padded passes' sharing)
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
    t.train()
    assert checked  # the reference pass ran, and the step after it
    assert all(d is None or d < 1e-5 for d in checked), checked  # declined (full forward), or the same numbers


def test_resume_continues_to_the_same_weights(tiny_model_dir, tmp_path):
    """Resume from the step-2 checkpoint and finish: the weights equal those of a run never interrupted."""
    straight = base_config(tmp_path / "a", max_steps=4)
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=straight, train_dataset=prompts())
    t.train()
    want = {k: v.clone() for k, v in t.policy.state_dict().items()}

    interrupted = base_config(tmp_path / "b", max_steps=4, save_steps=2)  # leaves checkpoint-2
    GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=interrupted, train_dataset=prompts()).train()
    # (named: the run went on to finish, and `resume: true` of a finished run does nothing)
    resumed = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a],
                          args=base_config(tmp_path / "b", max_steps=4), train_dataset=prompts())
    resumed.train(resume_from_checkpoint=str(Path(interrupted.output_dir) / "checkpoint-2"))
    assert resumed.step == 4
    got = resumed.policy.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0


def test_tied_embedding_gradient_is_sparse_only_while_training(tiny_model_dir, tmp_path):
    """The loop makes the tied input embedding's gradient sparse (no second (V, H) buffer per micro-batch) and hands
    the model back as it was loaded: afterwards a loss on the hidden states alone gets a dense gradient, which
    AdamW takes (it refuses a sparse one)."""
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=base_config(tmp_path, max_steps=1),
                    train_dataset=prompts())
    emb = t.policy.get_input_embeddings()
    assert t.backend.sparse_embedding and emb.sparse
    t.train()
    assert not emb.sparse
    t.policy.zero_grad(set_to_none=True)
    t.policy.model(input_ids=torch.tensor([[3, 4, 5]])).last_hidden_state.sum().backward()
    assert not emb.weight.grad.is_sparse
    torch.optim.AdamW(t.policy.parameters()).step()


def test_a_float16_loss_scale_is_undone_before_clipping(tiny_model_dir, tmp_path, monkeypatch):
    """Under a float16 loss scaler (accelerate's, on a GPU) the gradient norm is taken and clipped unscaled, so the
    logged norm and the update are the unscaled run's; an overflow skips the step and halves the scale, so it does
    not recur at every step. On the CPU accelerate makes no scaler: one is put where accelerate keeps it."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from torch.amp import GradScaler

    def trainer(name, scale=None):
        cfg = base_config(tmp_path / name, max_steps=2, max_grad_norm=1e-3)
        t = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg, train_dataset=prompts())
        # as they are with a scaler
        t.backend.fused_loss = t.backend.sampling_estimates = t.backend.lend_head_grad = False
        if scale is not None:
            t.accel.scaler = GradScaler("cpu", init_scale=scale)
            t.accel.native_amp = True
            t.optimizer = AcceleratedOptimizer(t.optimizer.optimizer, device_placement=False, scaler=t.accel.scaler)
            t.accel._optimizers = [t.optimizer]
        return t

    monkeypatch.setattr(Accelerator, "mixed_precision", property(lambda self: "fp16"))
    # (only the scaler is emulated: float16 autocast on the CPU would round the scaled run's passes differently)
    monkeypatch.setattr(Accelerator, "autocast", lambda self, *a, **kw: contextlib.nullcontext())

    plain, scaled = trainer("plain"), trainer("scaled", scale=2.0**10)
    norms = [plain.train_step()["train/grad_norm"], scaled.train_step()["train/grad_norm"]]
    assert norms[0] > 1e-3 and norms[1] == pytest.approx(norms[0], rel=1e-4), norms  # (clipped: above max_norm)
    for k, v in plain.policy.state_dict().items():
        torch.testing.assert_close(scaled.policy.state_dict()[k], v, rtol=1e-4, atol=1e-6)

    overflow = trainer("overflow", scale=2.0**10)
    before = {k: v.clone() for k, v in overflow.policy.state_dict().items()}
    hook = overflow.policy.model.norm.weight.register_hook(lambda g: g * math.inf)  # as a float16 overflow would
    metrics = overflow.train_step()
    hook.remove()
    assert not math.isfinite(metrics["train/grad_norm"]) and overflow.loop.nonfinite_in_a_row == 1
    assert overflow.accel.scaler.get_scale() == 2.0**9  # lowered by the scaler's own step, which updated nothing
    assert all(torch.equal(v, before[k]) for k, v in overflow.policy.state_dict().items())
    overflow.step += 1
    assert math.isfinite(overflow.train_step()["train/grad_norm"]) and overflow.loop.nonfinite_in_a_row == 0


@pytest.mark.parametrize("reward", [count_a, "rewards_for_tests:count_a"])
def test_one_reward_function_is_accepted_alone(tiny_model_dir, tmp_path, reward):
    """TRL's quickstarts pass `reward_funcs=accuracy_reward` (one callable) or a single name: both mean a list of
    one (a string was read letter by letter before)."""
    t = GRPOTrainer(model=tiny_model_dir, reward_funcs=reward, args=base_config(tmp_path, max_steps=1),
                    train_dataset=prompts())
    assert t.reward_names == ["count_a"]
    assert "reward/count_a" in t.train_step()
