"""The GPU check's throughput check, grpo alone (bench/gpu_check.py runs it as E1): `GRPOTrainer` at the GPU
recipe's settings (recipes/gpu/qwen2.5-0.5b-gsm8k.yaml: 32 prompts x 8 completions of up to 512 tokens, micro-batches
of 16, fp32 weights under bf16 autocast, beta 0.04, lr 1e-6) on a randomly initialised model of Qwen2.5-0.5B's shape,
with neither TRL nor `datasets` (check D needs both).

What stands in for the recipe's hub downloads: the model is built on the device from its config; the tokenizer is
bench's character tokenizer (bench/model_files.py), whose EOS lies outside the model's vocabulary, so every completion
runs to max_completion_length and every step does the same work, the recipe's longest; the prompts are 150
characters (= tokens; a GSM8K question under the recipe's system prompt and Qwen's template is ~100-200 tokens); the
reward is the share of digits in a completion's text (`reward_digits`: microseconds; GSM8K's math_accuracy scores
text, not the GPU), which varies within every group, so every step has advantages and moves the weights. On the CPU
(--cpu) the same code on a tiny model and batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from bench.gpu_check import ROOT, Context, criteria, peak_gib, qwen_like, reset_peak
from bench.gpu_check_train import SamplerGap, gap_criteria

RECIPE = ROOT / "recipes" / "gpu" / "qwen2.5-0.5b-gsm8k.yaml"
# The recipe's keys for its model, data, rewards and run length are replaced (above); every other key is taken.
REPLACED = {"model_name_or_path", "dataset_name", "dataset_config", "dataset_split", "prompt_column", "system_prompt",
            "prefill", "reward_funcs", "reward_weights", "max_steps", "save_steps", "eval_steps", "output_dir", "task"}
PROMPT_TOKENS = 150


def reward_digits(completions, **kwargs) -> list[float]:
    """The share of digits in each completion. The random model's completions are mostly the tokenizer's
    placeholders `<|tNNN|>`, whose digit counts differ (a vowel reward would be 0 for every row: no advantages)."""
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]


def recipe_settings(ctx: Context) -> dict:
    """The recipe's settings that shape the work (batch, lengths, precision, loss), tiny on the CPU."""
    from grpo.config.files import read_yaml

    values = {k: v for k, v in read_yaml(RECIPE).items() if k not in REPLACED}
    if not ctx.cuda:
        values.update(num_generations=4, prompts_per_step=2, per_device_train_batch_size=4, max_completion_length=16,
                      max_prompt_length=64, num_threads=1)
    return values


def check_recipe_throughput(ctx: Context) -> dict:
    """E1: 2 steps of the recipe (the second measured; the first pays for kernel choice and the allocator's
    growth): generation and update tokens/s, the reference pass, and the trainer's own memory/peak_gib."""
    from transformers import GenerationConfig

    from bench.model_files import build_tokenizer
    from bench.workloads import WORKLOADS, prompts
    from grpo import GRPOConfig, GRPOTrainer

    settings = recipe_settings(ctx)
    model = qwen_like(ctx, torch.float32, "sdpa").train()  # (float32 weights: the recipe's torch_dtype)
    vocab = model.config.vocab_size
    tokenizer = build_tokenizer(vocab)  # (EOS = id vocab: no logit, never sampled)
    model.generation_config = GenerationConfig(eos_token_id=vocab, pad_token_id=vocab)
    steps, prompt_tokens = 2, PROMPT_TOKENS if ctx.cuda else 12
    data = prompts(dataclasses.replace(WORKLOADS["Q05"], prompt_length=prompt_tokens),
                   n=settings["prompts_per_step"] * steps)
    cfg = GRPOConfig(**settings, output_dir=str(ctx.out / "e1"), task=None, max_steps=steps, save_steps=0,
                     eval_steps=0, report_to=[], disable_tqdm=True, log_completions_steps=0, logging_steps=1, seed=0,
                     use_cpu=not ctx.cuda)
    reset_peak(ctx)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_digits], args=cfg, processing_class=tokenizer,
                          train_dataset=[{"prompt": p} for p in data])
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    gap = SamplerGap(trainer)
    trainer.train()
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in trainer.policy.named_parameters() if n in before)
    rows = [json.loads(line) for line in open(Path(cfg.output_dir) / "metrics.jsonl") if '"time/step"' in line]
    last = rows[-1]
    completion = last["completion/mean_length"] * cfg.prompts_per_step * cfg.num_generations
    expected = cfg.prompts_per_step * cfg.num_generations * cfg.max_completion_length
    # (completion tokens per second of each phase; completion/tokens, TRL's num_tokens, counts the prompts too)
    step = dict(tokens_per_s=completion / last["time/step"],
                generation_tokens_per_s=completion / last["time/generation"],
                update_tokens_per_s=completion / last["time/update"],
                update_prompt_and_completion_tokens_per_s=last["completion/tokens"] / last["time/update"],
                **{k.removeprefix("time/") + "_s": round(v, 3) for k, v in last.items() if k.startswith("time/")})
    peaks = [r.get("memory/peak_gib") for r in rows]
    out = dict(settings={k: settings[k] for k in ("num_generations", "prompts_per_step", "per_device_train_batch_size",
                                                 "max_completion_length", "torch_dtype", "bf16", "beta")},
               prompt_tokens=prompt_tokens, parameters=sum(p.numel() for p in trainer.policy.parameters()),
               completion_tokens_per_step=completion, steps=len(rows), measured_step=step,
               first_step_s=round(rows[0]["time/step"], 3), memory_peak_gib_per_step=peaks, run_peak_gib=peak_gib(ctx),
               frac_weights_changed=round(changed / sum(v.numel() for v in before.values()), 4),
               sampler_logp_gap=gap.summary(), passes=trainer.micro.describe(), engine=trainer.engine.name)
    checks = {"every completion ran to max_completion_length": completion == expected,
              "loss and grad_norm finite": all(math.isfinite(last[k]) for k in ("train/loss", "train/grad_norm")),
              "weights changed (fp32 weights at lr 1e-6)": out["frac_weights_changed"] > 0.5,
              **gap_criteria(out["sampler_logp_gap"], trainer.accel.mixed_precision)}
    if ctx.cuda:  # the trainer's per-step peak, never above the whole run's (the check's own counter)
        checks["memory/peak_gib logged every step, within the run's peak"] = all(
            p is not None and 0 < p <= out["run_peak_gib"] + 1e-3 for p in peaks)
    else:
        checks["no memory/peak_gib on the CPU"] = all(p is None for p in peaks)
    return {**out, **criteria(checks)}


THROUGHPUT_CHECKS = {"E1": check_recipe_throughput}
