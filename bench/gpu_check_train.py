"""The GPU check's training checks (bench/gpu_check.py runs them): the trainer end to end on the shipped tiny-arith
model, and grpo against TRL on a Qwen2.5-0.5B-shaped random model (bench/run.py). Each returns its JSON record's
fields; bench/gpu_check.py adds the check's name, status and seconds."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_check import ROOT, Context, criteria, import_status, peak_gib, reset_peak, skipped

TINY = str(ROOT / "grpo" / "assets" / "tiny-arith")


def training_config(ctx: Context, name: str, steps: int, **over):
    """The default job's settings (8 x 8 completions of 64 tokens; 4 x 4 on the CPU) in a fresh
    run directory, with `over` on top."""
    from grpo import GRPOConfig

    values = dict(output_dir=str(ctx.out / name), model_name_or_path=TINY, task="arithmetic", max_steps=steps,
                  save_steps=0, report_to=[], disable_tqdm=True, task_eval_size=0, log_completions_steps=0,
                  seed=0, logging_steps=1, beta=0.04, use_cpu=not ctx.cuda, torch_dtype="float32", bf16=True)
    values.update((dict(num_generations=8, prompts_per_step=8, max_completion_length=64) if ctx.cuda else
                   dict(num_generations=4, prompts_per_step=4, max_completion_length=64, num_threads=1)))
    values.update(over)
    return GRPOConfig(**values)


def train(ctx: Context, cfg) -> dict:
    """Train `cfg`; seconds, peak memory, the fraction of trainable weights changed, the reward over the first and
    last 10 steps, the last step's phase times and policy figures, and how the passes ran."""
    from grpo import GRPOTrainer

    reset_peak(ctx)
    trainer = GRPOTrainer(args=cfg)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in trainer.policy.named_parameters() if n in before)
    total = sum(v.numel() for v in before.values())
    rows = [json.loads(line) for line in open(Path(cfg.output_dir) / "metrics.jsonl") if '"reward/total"' in line]
    rewards = [r["reward/total"] for r in rows]
    last = rows[-1]
    keys = ("policy/ratio_mean", "policy/kl_divergence", "train/grad_norm", "policy/clip_frac")
    return dict(steps=len(rows), seconds=round(seconds, 2), s_per_step=round(seconds / max(1, len(rows)), 3),
                peak_gib=peak_gib(ctx), frac_weights_changed=round(changed / total, 4),
                reward_first10=round(statistics.mean(rewards[:10]), 4),
                reward_last10=round(statistics.mean(rewards[-10:]), 4),
                times={k: round(v, 4) for k, v in last.items() if k.startswith("time/")},
                last={k: last.get(k) for k in keys}, param_dtype=str(next(trainer.policy.parameters()).dtype),
                engine=trainer.engine.name, passes=trainer.micro.describe())


def check_default_job(ctx: Context) -> dict:
    """C1: the default job's loop (fp32 weights, bf16 autocast, lr 2e-4): it learns over 120 steps on a GPU (40 with
    --quick, 2 on the CPU, where only the loop's figures are checked)."""
    steps = (40 if ctx.quick else 120) if ctx.cuda else 2
    out = train(ctx, training_config(ctx, "c1", steps, learning_rate=2e-4))
    ratio, kl, grad = (out["last"][k] for k in ("policy/ratio_mean", "policy/kl_divergence", "train/grad_norm"))
    checks = {"ratio_mean within 1 +- 1e-3": ratio is not None and abs(ratio - 1) <= 1e-3,
              "kl and grad_norm finite": all(v is not None and math.isfinite(v) for v in (kl, grad)),
              "weights changed": out["frac_weights_changed"] > 0.5}
    if steps >= 100:
        checks["reward_last10 > reward_first10"] = out["reward_last10"] > out["reward_first10"]
    return {**out, **criteria(checks)}


def lr_1e6(ctx: Context, name: str, dtype: str, bf16: bool) -> dict:
    """5 steps at lr 1e-6 (2 on the CPU): the fraction of weights changed. A start refused with a ConfigError (the
    trainer declining bf16 weights under a torch optimizer) is reported as `refused`."""
    from grpo.config import ConfigError

    try:
        cfg = training_config(ctx, name, 5 if ctx.cuda else 2, learning_rate=1e-6, torch_dtype=dtype, bf16=bf16)
        return train(ctx, cfg)
    except ConfigError as err:
        return {"refused": str(err)}


def check_bf16_weights(ctx: Context) -> dict:
    """C2: the GPU recipe's precision (bf16 weights, no autocast) at lr 1e-6: few weights change (D1), or the run is
    refused at start. Reported, not judged: either is the finding."""
    return lr_1e6(ctx, "c2", "bfloat16", False)


def check_fp32_master(ctx: Context) -> dict:
    """C2b: fp32 weights under bf16 autocast at lr 1e-6: nearly every weight changes."""
    out = lr_1e6(ctx, "c2b", "float32", True)
    return {**out, **criteria({"most weights change": out.get("frac_weights_changed", 0) > 0.5})}


def check_lora_resume(ctx: Context) -> dict:
    """C3: LoRA, checkpoints every 3 steps (1 on the CPU), 6 steps (2); then a resume to 9 (3) from the last
    checkpoint, and the merged `final/` loads with transformers."""
    from transformers import AutoModelForCausalLM

    from grpo import GRPOTrainer

    every, first, more = (3, 6, 9) if ctx.cuda else (1, 2, 3)
    lora = dict(use_peft=True, learning_rate=1e-3, save_steps=every)
    out = train(ctx, training_config(ctx, "c3", first, **lora))
    resumed = GRPOTrainer(args=training_config(ctx, "c3", more, **lora))
    resumed.train(resume_from_checkpoint=True)
    final = ctx.out / "c3" / "final"
    model = AutoModelForCausalLM.from_pretrained(str(final))
    return {**out, "resumed_to": resumed.step, "final_parameters": sum(p.numel() for p in model.parameters()),
            **criteria({f"resumed to step {more}": resumed.step == more})}


def check_against_trl(ctx: Context) -> dict:
    """D: grpo and TRL's GRPOTrainer on the same work (bench/run.py): on a GPU the Q05 workload (Qwen2.5-0.5B's
    shape, random weights, 4 x 8 completions of 256 tokens) with fp32 weights and bf16 autocast on both sides; on
    the CPU the `mini` workload. Tokens per second, seconds per step and peak memory of each side."""
    missing = {name: why for name in ("datasets", "trl") if (why := import_status(name)) != "yes"}
    if missing:
        return skipped(f"TRL (and datasets, which it needs) does not import: {missing}; carry their wheels "
                       "(bench/README.md)")
    workload, steps = ("Q05", 2 if ctx.quick else 3) if ctx.cuda else ("mini", 1)
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--workload", workload, "--steps", str(steps),
           "--warmup", "1" if ctx.cuda else "0", "--rounds", "1", "--work-dir", str(ctx.out / "d")]
    if ctx.cuda:
        cmd += ["--grpo-set", "bf16=true", "--trl-set", "bf16=true"]
    else:
        cmd += ["--threads", "1", "--grpo-set", "use_cpu=true", "--trl-set", "use_cpu=true"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench/run.py exited {done.returncode}: {done.stderr[-1200:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    keys = ("tokens_per_s", "s_per_step", "peak_gpu_mb", "peak_rss_mb", "time_split_s")
    return {"workload": workload, "speedup": result["speedup"], "versions": result["versions"],
            **{f"{side}_{k}": result.get(f"{side}_{k}") for side in ("grpo", "trl") for k in keys}}


TRAINING_CHECKS = {"C1": check_default_job, "C2": check_bf16_weights, "C2b": check_fp32_master,
                   "C3": check_lora_resume, "D": check_against_trl}
