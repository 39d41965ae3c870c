"""What a run says and writes at its start (what it is about to do), at each logged step, and at its end."""

from __future__ import annotations

from pathlib import Path

from grpo.engines.sharding import whole_numel
from grpo.training.sharded import describe


class TrainResult(dict):
    """The last step's metrics (a dict, as `train()` returned before), with TRL's TrainOutput fields:
    `global_step`, `training_loss` (the mean over the run's steps) and `metrics` (the last step's, and the
    end-of-training summary: train_runtime, train_loss, ...)."""

    def __init__(self, metrics: dict[str, float], global_step: int, summary: dict[str, float] | None = None):
        super().__init__(metrics)
        self.global_step = global_step
        self.training_loss = (summary or {}).get("train_loss", metrics.get("train/loss", float("nan")))
        self.metrics = {**metrics, **(summary or {})}


def resolved_config(trainer) -> dict:
    """The config that runs: the keys as given, with what the trainer resolved in place of what it was not told
    (the task's or the given reward functions and weights, a given model's name, the task left out when a
    train_dataset was given). A valid recipe: `grpo train config.yaml` reads it."""
    values = trainer.cfg.to_dict()
    specs = trainer.rewards.specs
    values["reward_funcs"] = [s if isinstance(s, (str, dict)) else str(s) for s in specs]
    values["reward_weights"] = list(trainer.rewards.weights[:len(specs)])
    values["model_name_or_path"] = getattr(trainer.policy, "name_or_path", None) or values["model_name_or_path"]
    values["prefill"] = trainer.prefill
    if trainer.task is None:
        values["task"] = None
    return values


def write_run_files(trainer, out: Path) -> None:
    """The run directory's config.yaml (the resolved config) and layout.yaml (the resolved batch layout); a
    checkpoint keeps both too."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    from grpo.config.files import plain

    (out / "config.yaml").write_text(yaml.safe_dump(plain(resolved_config(trainer)), sort_keys=False))
    (out / "layout.yaml").write_text(yaml.safe_dump(trainer.layout.to_dict(), sort_keys=False))


def log_step(trainer, logger, display, step: int, metrics: dict[str, float]) -> None:
    """Log one step's metrics under the names metric_names asks for, show them, and tell the callbacks."""
    from grpo.training.metric_names import named

    logs = named(metrics, trainer.cfg.metric_names, trainer.reward_names)
    summary = getattr(trainer, "_summary", None)
    if summary is not None:
        summary.logged()  # (the end-of-training entry carries only the steps after this one)
    logger.log(step, logs)
    display.update(step, metrics)
    trainer.control.logged(step, logs)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _prompts(train_set) -> str:
    from grpo.training.stream import prompt_count

    count = prompt_count(train_set)
    return "streamed prompts" if count is None else f"{count} prompts"


def start_lines(trainer) -> list[str]:
    cfg, policy = trainer.cfg, trainer.policy
    total = sum(whole_numel(p) for p in policy.parameters())
    trained = sum(whole_numel(p) for p in policy.parameters() if p.requires_grad)
    params = _count(total) + ("" if trained == total else f", {_count(trained)} trained (LoRA)")
    data = (f"task {cfg.task}" if trainer.task is not None else cfg.dataset_name or "the given train_dataset")
    evals = f", {len(trainer.eval_set)} eval" if trainer.eval_set is not None else ""
    weights = trainer.rewards.weights
    rewards = ", ".join(f"{n} x{w:g}" for n, w in zip(trainer.reward_names, weights))
    count = trainer.accel.num_processes
    device = f"{trainer.accel.device}, {count} process" + ("es" if count > 1 else "")
    if trainer.procs.sp_size > 1:
        device += f" ({trainer.world} data-parallel groups of {trainer.procs.sp_size})"
    device += describe(trainer.accel, cfg)
    return [f"model    {cfg.model_name_or_path} ({params} parameters)",
            f"data     {data}: {_prompts(trainer.train_set)}{evals}",
            f"rewards  {rewards}",
            *([f"agents   {trainer.agents.describe()}"] if trainer.agents else []),
            f"engine   {trainer.engine.name} ({trainer.engine.reason})"
            + (f"; rollouts from vLLM ({cfg.vllm_mode})" if cfg.use_vllm else ""),
            f"device   {device}",
            f"passes   {trainer.micro.describe()}",
            f"rollouts {trainer.source.layout}",
            f"steps    {trainer.total_steps} optimizer steps from step {trainer.step}; rollouts of {trainer.B} prompts "
            f"x {trainer.G} completions, each feeding {trainer.layout.rollout_steps} step(s) of "
            f"{trainer.layout.step_completions} completions",
            f"output   {cfg.output_dir}"]


def end_lines(trainer, last: dict[str, float], seconds: float) -> list[str]:
    minutes, secs = divmod(int(round(seconds)), 60)
    shown = [k for k in ("reward/total", "eval/accuracy", "policy/kl_divergence") if k in last]
    metrics = ", ".join(f"{k} {last[k]:.3f}" for k in shown)
    failures = [*trainer.rewards.failure_summary(), *trainer.health.summary()]  # (one line each, not per failure)
    auto = "AutoModelForImageTextToText" if getattr(trainer, "images", None) is not None else "AutoModelForCausalLM"
    return [f"done     {trainer.step} steps in {minutes}m{secs:02d}s" + (f"; {metrics}" if metrics else ""),
            *(f"WARNING  {line}" for line in failures),
            f"model    {trainer.cfg.output_dir}/final ({auto}.from_pretrained loads it)"]


def finish_run(out) -> None:
    """Draw the run's plot; a plot that fails is a warning, never a lost run."""
    try:
        from grpo.training.plot import plot_run

        plot_run(out)
    except Exception as err:  # noqa: BLE001 - the model is saved already
        print(f"warning: could not draw the plot: {err}")
