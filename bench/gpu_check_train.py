"""The GPU check's training checks (bench/gpu_check.py runs them): the trainer end to end on the shipped tiny-arith
and tiny-vision models, and grpo against TRL on a Qwen2.5-0.5B-shaped random model (bench/run.py). Each returns its
JSON record's fields; bench/gpu_check.py adds the check's name, status and seconds.

    python -m bench.gpu_check_train determinism OUT_DIR [--cpu]    # C4's fresh process (a JSON line on stdout)
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `grpo` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import ROOT, Context, criteria, import_status, peak_gib, reset_peak, skipped

TINY = str(ROOT / "grpo" / "assets" / "tiny-arith")
TINY_VISION = str(ROOT / "grpo" / "assets" / "tiny-vision")


class SamplerGap:
    """The sampler's log-probs of each completion token (what it sampled from) against the update pass's log-probs
    of the same tokens, on the same weights: the rollout's first optimizer step, before any weight moves. A gap
    beyond the compute precision means the engine and the trainer disagree (temperature, positions, masks, the
    cache). Installed on `trainer.updates._micro_step`; nothing is read back from the device until `summary`."""

    def __init__(self, trainer):
        self.trainer, self.parts = trainer, []
        micro_step = trainer.updates._micro_step

        def watched(batch, plan, counts):
            logp, out, tokens = micro_step(batch, plan, counts)
            if batch.sampling_logp is not None and trainer.layout.rollout_steps == 1:
                mask = plan.take(batch.completion_mask, logp.device) > 0
                sampled = plan.take(batch.sampling_logp, logp.device)
                gap = torch.where(mask, (logp.float() - sampled.float()).abs(), 0.0)
                self.parts.append((trainer.step, torch.stack([gap.sum(), gap.max(), mask.sum().float()])))
            return logp, out, tokens

        trainer.updates._micro_step = watched

    def summary(self) -> dict | None:
        """mean and max absolute gap over every token, the worst step's mean, tokens; None if the sampler gave none."""
        if not self.parts:
            return None
        rows = torch.stack([p for _, p in self.parts]).double().cpu()
        steps: dict[int, list[float]] = {}
        for (step, _), (total, _, tokens) in zip(self.parts, rows.tolist()):
            acc = steps.setdefault(step, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + total, acc[1] + tokens
        return dict(mean=float(rows[:, 0].sum() / rows[:, 2].sum().clamp(min=1)), max=float(rows[:, 1].max()),
                    worst_step_mean=max(total / max(tokens, 1.0) for total, tokens in steps.values()),
                    tokens=int(rows[:, 2].sum()), steps=len(steps))


def gap_criteria(gap: dict | None, mixed_precision: str) -> dict[str, bool]:
    """The sampler-against-update criterion: every step's mean gap within the compute precision's bound, B1's: 1e-2
    under bf16 autocast (8 bits of mantissa: log-probs of a few nats a few 1e-3 off), 1e-4 in float32. A real
    mismatch (another temperature, shifted positions, a stale weight) is 0.1-1 nat."""
    bound = 1e-2 if mixed_precision in ("bf16", "fp16") else 1e-4
    if gap is None:
        return {"the sampler gave its log-probs": False}
    return {f"sampler against update: every step's mean gap <= {bound:g}": gap["worst_step_mean"] <= bound}


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(args=cfg)
    for w in caught:  # (shown as they would have been; the record keeps the trainer's own)
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    gap = SamplerGap(trainer)
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
                engine=trainer.engine.name, passes=trainer.micro.describe(), sampler_logp_gap=gap.summary(),
                mixed_precision=trainer.accel.mixed_precision,
                warnings=[str(w.message)[:300] for w in caught if issubclass(w.category, UserWarning)])


def check_default_job(ctx: Context) -> dict:
    """C1: the default job's loop (fp32 weights, bf16 autocast, lr 2e-4): it learns over 100 steps on a GPU (40 with
    --quick, 2 on the CPU, where only the loop's figures are checked), and the sampler's log-probs agree with the
    update's (SamplerGap). (The importance ratio is no criterion: with one optimizer step per rollout it is 1 by
    construction.)"""
    steps = (40 if ctx.quick else 100) if ctx.cuda else 2
    out = train(ctx, training_config(ctx, "c1", steps, learning_rate=2e-4))
    kl, grad = (out["last"][k] for k in ("policy/kl_divergence", "train/grad_norm"))
    checks = {"kl and grad_norm finite": all(v is not None and math.isfinite(v) for v in (kl, grad)),
              "weights changed": out["frac_weights_changed"] > 0.5,
              **gap_criteria(out["sampler_logp_gap"], out["mixed_precision"])}
    if steps >= 100:
        checks["reward_last10 > reward_first10"] = out["reward_last10"] > out["reward_first10"]
    return {**out, **criteria(checks)}


def lr_1e6(ctx: Context, name: str, dtype: str, bf16: bool) -> dict:
    """5 steps at lr 1e-6 (3 with --quick, 2 on the CPU): the fraction of weights changed. A start refused with a
    ConfigError (the trainer declining bf16 weights under a torch optimizer) is reported as `refused`."""
    from grpo.config import ConfigError

    try:
        steps = (3 if ctx.quick else 5) if ctx.cuda else 2
        return train(ctx, training_config(ctx, name, steps, learning_rate=1e-6, torch_dtype=dtype, bf16=bf16))
    except ConfigError as err:
        return {"refused": str(err)}


def check_bf16_weights(ctx: Context) -> dict:
    """C2: the GPU recipe's old precision (bf16 weights, no autocast) at lr 1e-6: few weights change (D1), and the
    trainer says so at the start (its low-precision warning), or refuses the run."""
    out = lr_1e6(ctx, "c2", "bfloat16", False)
    warned = any("rounded away" in w for w in out.get("warnings", []))
    return {**out, **criteria({"the trainer warns that the steps round away (or refuses)": warned or "refused" in out})}


def check_fp32_master(ctx: Context) -> dict:
    """C2b: fp32 weights under bf16 autocast at lr 1e-6: nearly every weight changes, with no warning."""
    out = lr_1e6(ctx, "c2b", "float32", True)
    return {**out, **criteria({"most weights change": out.get("frac_weights_changed", 0) > 0.5,
                               "no low-precision warning": not any("rounded away" in w
                                                                   for w in out.get("warnings", []))})}


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
    shape, random weights, 4 x 8 completions of 256 tokens) with fp32 weights and bf16 autocast on both sides, 1
    measured step after 1 of warm-up (most of D's time is building the model and starting the sides); on the CPU
    the `mini` workload. Tokens per second, seconds
    per step and peak memory of each side; on a GPU grpo must be at least as fast (1.61x on one H200, 2026-11-28).
    No speed criterion on the CPU: CI's machines are shared, and the mini workload is all overhead."""
    missing = {name: why for name in ("datasets", "trl") if (why := import_status(name)) != "yes"}
    if missing:
        return skipped(f"TRL (and datasets, which it needs) does not import: {missing}; carry their wheels "
                       "(bench/README.md)")
    workload, steps = ("Q05", 1) if ctx.cuda else ("mini", 1)
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
    keys = ("tokens_per_s", "s_per_step", "completion_tokens_per_step", "peak_gpu_mb", "peak_rss_mb",
            "time_split_s")
    out = {"workload": workload, "speedup": result["speedup"], "versions": result["versions"],
           **{f"{side}_{k}": result.get(f"{side}_{k}") for side in ("grpo", "trl") for k in keys}}
    checks = {"the same completion tokens per step on both sides": (
        out["grpo_completion_tokens_per_step"] == out["trl_completion_tokens_per_step"]
        == result["completion_tokens_per_step"])}
    if ctx.cuda:
        checks["grpo at least TRL's tokens/s"] = result["speedup"] is not None and result["speedup"] >= 1.0
    return {**out, **criteria(checks)}


def final_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu() for n, p in trainer.policy.named_parameters()}


def determinism_runs(out: Path, cpu: bool) -> dict:
    """C4's two runs (in the fresh process `python -m bench.gpu_check_train determinism`): the default job with
    full_determinism, 2 steps (1 on the CPU), twice from the same seed; the weights' and the metrics' differences."""
    from grpo import GRPOTrainer

    ctx = Context(torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu"), False, out)
    weights, rows = [], []
    for run in range(2):
        trainer = GRPOTrainer(args=training_config(ctx, f"c4-{run}", 2 if ctx.cuda else 1, learning_rate=2e-4,
                                                   full_determinism=True))
        trainer.train()
        weights.append(final_weights(trainer))
        rows.append([json.loads(line) for line in open(out / f"c4-{run}" / "metrics.jsonl") if '"train/loss"' in line])
        del trainer
    keys = ("train/loss", "train/grad_norm", "reward/total", "policy/kl_divergence")
    differing = sorted({k for a, b in zip(*rows) for k in keys if a.get(k) != b.get(k)})
    return dict(steps=len(rows[0]), weights_max_abs_diff=max(float((weights[0][n] - weights[1][n]).abs().max())
                                                             for n in weights[0]),
                metrics_differing=differing, deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
                cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def check_full_determinism(ctx: Context) -> dict:
    """C4: `full_determinism: true` (D19), two runs of the default job from the same seed in a fresh process (the
    setting is process-wide and must be in place before cuBLAS starts): the same weights, bit for bit, and the same
    losses, gradient norms and rewards."""
    cmd = [sys.executable, "-m", "bench.gpu_check_train", "determinism", str(ctx.out)] + ([] if ctx.cuda else ["--cpu"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the determinism runs exited {done.returncode}: {done.stderr[-1200:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {**out, **criteria({"the same weights": out["weights_max_abs_diff"] == 0.0,
                               "the same metrics": not out["metrics_differing"],
                               "deterministic algorithms on": out["deterministic_algorithms"]})}


def check_vision(ctx: Context) -> dict:
    """C5: the tiny VLM (grpo/assets/tiny-vision, Qwen2-VL-shaped, M-RoPE) on the shapes task end to end at fp32
    weights under bf16 autocast, 2 steps: images through the processor, generation, the update; the
    sampler's log-probs against the update's (M-RoPE positions in decode and in the padded pass must agree)."""
    if (why := import_status("PIL")) != "yes":
        return skipped(f"Pillow does not import ({why}): the shapes task draws its pictures with it, and the image "
                       "processor reads them; carry its wheel (bench/README.md)")
    from transformers import AutoImageProcessor

    try:  # (transformers 5.17's Qwen2-VL image processor needs torchvision; later ones have a PIL backend)
        AutoImageProcessor.from_pretrained(TINY_VISION)
    except ImportError as err:
        return skipped(f"the tiny VLM's image processor does not load: {' '.join(str(err).split())[:200]}; carry "
                       "the torchvision wheel for this torch (bench/README.md)")
    rows = dict(num_generations=8, prompts_per_step=8) if ctx.cuda else {}
    cfg = training_config(ctx, "c5", 2, model_name_or_path=TINY_VISION, task="shapes",
                          task_train_size=64, max_completion_length=8, per_device_train_batch_size=64,
                          learning_rate=1e-4, beta=0.0, **rows)
    out = train(ctx, cfg)
    grad = out["last"]["train/grad_norm"]
    return {**out, **criteria({"every step ran": out["steps"] == cfg.max_steps,
                               "grad_norm finite": grad is not None and math.isfinite(grad),
                               "weights changed": out["frac_weights_changed"] > 0.5,
                               **gap_criteria(out["sampler_logp_gap"], out["mixed_precision"])})}


TRAINING_CHECKS = {"C1": check_default_job, "C2": check_bf16_weights, "C2b": check_fp32_master,
                   "C3": check_lora_resume, "C4": check_full_determinism, "C5": check_vision, "D": check_against_trl}


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "determinism":
        sys.exit("usage: python -m bench.gpu_check_train determinism OUT_DIR [--cpu]")
    result = determinism_runs(Path(sys.argv[2]), "--cpu" in sys.argv[3:])
    print(json.dumps(result), flush=True)
