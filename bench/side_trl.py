"""The TRL side: `trl.GRPOTrainer` on a workload, timed step by step (run by bench/child.py).

Needs TRL (bench/requirements.txt); nothing else imports it.

How TRL's loop maps onto a `grpo` step (one rollout of B x G completions, then num_iterations optimizer updates):
TRL generates `generation_batch_size` = B x G completions at once, then takes one optimizer step per pass over them
(`gradient_accumulation_steps` micro-batches of `per_device_train_batch_size`), num_iterations times. So one rollout
step is num_iterations TRL optimizer steps, and a callback closes a step after every num_iterations of them.

The phases are timed by wrapping TRL's own methods on the trainer instance: `_generate_single_turn` (sampling),
`_calculate_rewards` (reward functions) and `_get_per_token_logps_and_entropies` when called without gradients
(the reference and old-policy log-probs; with gradients it is the policy forward of the update).
"""

from __future__ import annotations

from bench.child import StepClock, timed
from bench.workloads import Workload, prompts, reward_vowels


def settings(w: Workload, steps: int, run_dir: str) -> dict:
    """TRL's GRPOConfig for workload w. Set explicitly: what makes the work identical to grpo's (batch layout, G,
    T, beta, num_iterations, learning rate and schedule, fp32); the rest are TRL's defaults, among them
    `gradient_checkpointing=True` and `loss_type="dapo"`."""
    import torch

    if w.completions_per_step % w.micro_batch:
        raise ValueError(f"settings: micro_batch {w.micro_batch} must divide B x G = {w.completions_per_step}.")
    return dict(
        output_dir=run_dir, seed=w.seed, bf16=False,  # TRL defaults to bf16; the benchmark is fp32 on both sides
        model_init_kwargs={"dtype": torch.float32},
        num_generations=w.num_generations, per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=w.completions_per_step // w.micro_batch,  # one optimizer step per pass over B x G
        max_completion_length=w.completion_length, temperature=1.0,
        beta=w.beta, num_iterations=w.num_iterations,
        learning_rate=w.learning_rate, lr_scheduler_type="constant", max_steps=steps * w.num_iterations,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )


def lora_config(w: Workload):
    from peft import LoraConfig

    return LoraConfig(r=w.lora_r, lora_alpha=w.lora_alpha, lora_dropout=w.lora_dropout,
                      target_modules="all-linear", task_type="CAUSAL_LM")


def train(w: Workload, model_dir: str, steps: int, run_dir: str, overrides: dict, clock: StepClock) -> dict:
    """Train `steps` rollout steps, recording into `clock`; returns the settings used."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = {**settings(w, steps, run_dir), **overrides}
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[reward_vowels], args=GRPOConfig(**cfg),
                          train_dataset=Dataset.from_dict({"prompt": prompts(w)}),
                          peft_config=lora_config(w) if w.lora_r else None)
    trainer._generate_single_turn = timed(clock, "generation", trainer._generate_single_turn,
                                          count=lambda out: sum(len(ids) for ids in out[0]))
    trainer._calculate_rewards = timed(clock, "scoring", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(clock, "logprobs", trainer._get_per_token_logps_and_entropies,
                                                       when=lambda: not torch.is_grad_enabled())

    class RolloutSteps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % w.num_iterations == 0:
                clock.end_step()

    trainer.add_callback(RolloutSteps())
    trainer.train()
    settings_used = {k: v for k, v in cfg.items() if k != "model_init_kwargs"}
    return {**settings_used, "lora": bool(w.lora_r), "gradient_checkpointing": trainer.args.gradient_checkpointing,
            "loss_type": trainer.args.loss_type, "steps_per_generation": trainer.args.steps_per_generation,
            "generation_batch_size": trainer.args.generation_batch_size}
