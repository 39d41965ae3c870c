"""TRL 1.16's `GRPOTrainer` given the default job's work: `python -m bench.trl_default_job --out DIR [key=value ...]`.

What "the same work" means here (bench/default_job.py runs this beside `grpo train` and compares):

* **the run's settings**: grpo's default recipe with the same `key=value` overrides, resolved by grpo's own
  `GRPOConfig.load`; every setting of the loss, the optimizer, the schedule and sampling is copied from it (`settings`);
* **the model**: the recipe's model (the shipped tiny-arith), float32 on both sides;
* **the prompts, in the same order**: the task's training problems as grpo renders them (prompt + prefill), in the
  order grpo's sampler draws them, B per step (`ordered_prompts`); TRL takes them in dataset order
  (`shuffle_dataset=False`) and repeats each G times, as grpo does;
* **the rewards**: grpo's own reward functions of the task (TRL's signature), with the task's weights;
* the recipe's `num_threads` torch threads (one; bench.default_job's `--threads N` sets it to N), printed at the end.

TRL keeps its own defaults elsewhere; it runs no evaluation during training (grpo's default job does, every 50
steps: that time counts against grpo). The final model and tokenizer go to DIR/final for `grpo eval`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

# grpo's loss_aggregation -> TRL's loss_type with the same normalizer (token_mean: over the whole step, as "dapo")
LOSS_TYPES = {"sequence_mean": "grpo", "token_mean": "dapo", "constant": "dr_grpo"}


def resolved_config(overrides: list[str]):
    from grpo.cli import DEFAULT_RECIPE
    from grpo.config import GRPOConfig

    return GRPOConfig.load(DEFAULT_RECIPE, overrides)


def ordered_prompts(cfg) -> dict[str, list]:
    """The training rows grpo's run draws, step by step, as TRL dataset columns: `prompt` rendered as grpo feeds it
    (the task's prefill appended) and every other column of the task (the rewards read `answer`)."""
    from grpo.tasks import get_task
    from grpo.training.data.prompts import PromptSampler, render_prompt
    from grpo.training.setup.data import make_datasets

    task = get_task(cfg.task)
    train, _ = make_datasets(cfg, task, None, None)
    if cfg.max_steps < 1:
        raise SystemExit("bench.trl_default_job: set max_steps (the default job's is 300).")
    sampler = PromptSampler(len(train), cfg.seed)
    order = [i for _ in range(cfg.max_steps) for i in sampler.next(cfg.prompts_per_step)]
    rows = train.select(order)
    prefill = cfg.prefill if cfg.prefill is not None else task.prefill
    columns = {name: list(rows[name]) for name in rows.column_names}
    columns["prompt"] = [render_prompt(p, None, cfg, prefill) for p in columns["prompt"]]
    return columns


def settings(cfg, out: Path) -> dict:
    """TRL GRPOConfig keyword arguments: every loss, optimizer and sampling setting of grpo's resolved config."""
    import torch

    batch = cfg.prompts_per_step * cfg.num_generations
    if batch % cfg.per_device_train_batch_size:
        raise SystemExit("bench.trl_default_job: per_device_train_batch_size must divide the step's completions.")
    return dict(
        output_dir=str(out), seed=cfg.seed, bf16=False, model_init_kwargs={"dtype": torch.float32},
        num_generations=cfg.num_generations, per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=batch // cfg.per_device_train_batch_size,  # one optimizer step per rollout
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k or None, min_p=cfg.min_p or None, repetition_penalty=cfg.repetition_penalty,
        beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, loss_type=LOSS_TYPES[cfg.loss_aggregation],
        scale_rewards=cfg.scale_rewards, importance_sampling_level=cfg.importance_sampling_level,
        mask_truncated_completions=cfg.mask_truncated_completions, num_iterations=cfg.num_iterations,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_steps or cfg.warmup_ratio,  # transformers 5: a float < 1 is a ratio of the steps
        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_epsilon, max_grad_norm=cfg.max_grad_norm,
        max_steps=cfg.max_steps * cfg.num_iterations, gradient_checkpointing=cfg.gradient_checkpointing,
        shuffle_dataset=False, logging_steps=cfg.logging_steps * 10, report_to="none", save_strategy="no",
        disable_tqdm=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="TRL's output directory (the model in OUT/final)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of grpo's default recipe")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from grpo.rewards import resolve_reward
    from grpo.tasks import get_task

    cfg = resolved_config(args.overrides)
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    task = get_task(cfg.task)
    weights = cfg.reward_weights or task.reward_weights
    funcs = [resolve_reward(name)[1] for name in (cfg.reward_funcs or task.reward_funcs)]
    trainer = GRPOTrainer(model=cfg.model_name_or_path, reward_funcs=funcs,
                          args=GRPOConfig(**settings(cfg, args.out), reward_weights=list(weights)),
                          train_dataset=Dataset.from_dict(ordered_prompts(cfg)))
    trainer.train()
    trainer.save_model(str(args.out / "final"))
    trainer.processing_class.save_pretrained(str(args.out / "final"))
    print(f"[bench.trl_default_job] {cfg.max_steps} steps in {time.perf_counter() - started:.0f} s with "
          f"{torch.get_num_threads()} torch thread(s)", flush=True)


if __name__ == "__main__":
    main()
