"""The `grpo` side: `grpo.GRPOTrainer` on a workload, timed step by step (run by bench/child.py).

The phases are timed by wrapping, on the trainer instance, the generator's `generate` (sampling), the reward runner
(reward functions) and `_score_logprobs` (the reference and old-policy log-probs), as bench/side_trl.py does on
TRL's side. Both count optimizer steps; a benchmark step is one rollout, which feeds num_iterations of them, so it
ends when the num_iterations-th `train_step` of its rollout returns (as TRL's side closes a step).
"""

from __future__ import annotations

from bench.child import StepClock, timed
from bench.workloads import Workload, prompts, reward_vowels


def settings(w: Workload, steps: int, run_dir: str) -> dict:
    """grpo's GRPOConfig for workload w. Every value that makes the work identical to TRL's is set explicitly;
    the rest are grpo's defaults (no gradient checkpointing, no top-k/top-p)."""
    out = dict(
        task=None, output_dir=run_dir, seed=w.seed, torch_dtype="float32",
        prompts_per_step=w.prompts_per_step, num_generations=w.num_generations,
        max_completion_length=w.completion_length, temperature=1.0,
        per_device_train_batch_size=w.micro_batch, beta=w.beta, num_iterations=w.num_iterations,
        learning_rate=w.learning_rate, lr_scheduler_type="constant", max_steps=steps * w.num_iterations,
        loss_type="dapo",  # TRL's default aggregation; with fixed-length completions every aggregation is equal
        save_steps=0, report_to=[], log_completions_steps=0, logging_steps=1,
    )
    if w.lora_r:
        out.update(use_peft=True, lora_r=w.lora_r, lora_alpha=w.lora_alpha, lora_dropout=w.lora_dropout,
                   lora_target_modules="all-linear")
    return out


def train(w: Workload, model_dir: str, steps: int, run_dir: str, overrides: dict, clock: StepClock) -> dict:
    """Train `steps` steps, recording into `clock`; returns the settings used."""
    from datasets import Dataset

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.engines.cpu import native

    native.keep_freed_memory()  # as the `grpo` command does in its own process
    cfg = {**settings(w, steps, run_dir), **overrides}
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[reward_vowels], args=GRPOConfig(**cfg),
                          train_dataset=Dataset.from_dict({"prompt": prompts(w)}))
    # The same three cuts as on TRL's side: sampling, the reward functions, the no-grad log-prob passes.
    trainer.generator.generate = timed(clock, "generation", trainer.generator.generate,
                                       count=lambda out: sum(len(ids) for ids in out.ids))
    trainer.rollouts.rewards = timed(clock, "scoring", trainer.rollouts.rewards)
    trainer._score_logprobs = timed(clock, "logprobs", trainer._score_logprobs)
    train_step, calls = trainer.train_step, [0]

    def timed_step():
        if calls[0] % w.num_iterations == 0:
            clock.begin()
        metrics = train_step()
        calls[0] += 1
        if calls[0] % w.num_iterations == 0:
            clock.end_step()
        return metrics

    trainer.train_step = timed_step
    trainer.train()
    return cfg
