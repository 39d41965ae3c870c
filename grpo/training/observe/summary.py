"""What a run says and writes at its start (what it is about to do), at each logged step, and at its end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.engines.sharding import whole_numel
from grpo.training.setup.sharded import describe


class TrainResult(dict):
    """The last step's metrics (a dict, as `train()` returned before), with TRL's TrainOutput fields:
    `global_step`, `training_loss` (the mean over the run's steps) and `metrics` (the last step's, and the
    end-of-training summary: train_runtime, train_loss, ...)."""

    def __init__(self, metrics: dict[str, float], global_step: int, summary: dict[str, float] | None = None):
        super().__init__(metrics)
        self.global_step = global_step
        self.training_loss = (summary or {}).get("train_loss", metrics.get("train/loss", float("nan")))
        self.metrics = {**metrics, **(summary or {})}


@dataclass
class RunFiles:
    """The run's config.yaml (the resolved config) and layout.yaml (the resolved batch layout), in the run directory
    and in each checkpoint."""

    cfg: Any
    rewards: Any  # grpo.rewards.runner.RewardRunner: the reward functions and weights that run
    model_name: str | None  # a given model's name (the config's otherwise)
    prefill: str
    has_task: bool
    layout: Any  # grpo.training.update.steps.Layout

    def resolved(self) -> dict:
        """The config that runs: the keys as given, with what the trainer resolved in place of what it was not told
        (the task's or the given reward functions and weights, a given model's name, the task left out when a
        train_dataset was given). A valid recipe: `grpo train config.yaml` reads it."""
        values = self.cfg.to_dict()
        specs = self.rewards.specs
        values["reward_funcs"] = [s if isinstance(s, (str, dict)) else str(s) for s in specs]
        values["reward_weights"] = list(self.rewards.weights[:len(specs)])
        values["model_name_or_path"] = self.model_name or values["model_name_or_path"]
        values["prefill"] = self.prefill
        if not self.has_task:
            values["task"] = None
        return values

    def write(self, out: Path) -> None:
        import yaml

        from grpo.config.files import plain

        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(plain(self.resolved()), sort_keys=False))
        (out / "layout.yaml").write_text(yaml.safe_dump(self.layout.to_dict(), sort_keys=False))


@dataclass
class StepLog:
    """Where a logged step's metrics go: every sink (`logger`), the display, the callbacks (`control`), under the
    names metric_names asks for; the end-of-training summary then carries only the steps after it."""

    logger: Any
    display: Any
    control: Any  # grpo.training.run.control.RunControl
    summary: Any  # grpo.training.trl_surface.TrainingSummary
    metric_names: str
    reward_names: list[str]

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        from grpo.training.observe.metric_names import named

        logs = named(metrics, self.metric_names, self.reward_names)
        self.summary.logged()
        self.logger.log(step, logs)
        self.display.update(step, metrics)
        self.control.logged(step, logs)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _prompts(train_set) -> str:
    from grpo.training.data.stream import prompt_count

    count = prompt_count(train_set)
    return "streamed prompts" if count is None else f"{count} prompts"


def start_lines(cfg, policy, *, has_task: bool, train_set, eval_set, rewards, reward_names: list[str], accel, procs,
                agents, engine, passes: str, rollouts: str, step: int, total_steps: int, layout) -> list[str]:
    """What the run is about to do, one line per part: model, data, rewards, agents, engine, device, passes, rollouts,
    steps, output."""
    total = sum(whole_numel(p) for p in policy.parameters())
    trained = sum(whole_numel(p) for p in policy.parameters() if p.requires_grad)
    params = _count(total) + ("" if trained == total else f", {_count(trained)} trained (LoRA)")
    data = (f"task {cfg.task}" if has_task else cfg.dataset_name or "the given train_dataset")
    evals = f", {len(eval_set)} eval" if eval_set is not None else ""
    weights = rewards.weights
    shown = ", ".join(f"{n} x{w:g}" for n, w in zip(reward_names, weights))
    count = accel.num_processes
    device = f"{accel.device}, {count} process" + ("es" if count > 1 else "")
    if procs.sp_size > 1:
        device += f" ({procs.world} data-parallel groups of {procs.sp_size})"
    device += describe(accel, cfg)
    return [f"model    {cfg.model_name_or_path} ({params} parameters)",
            f"data     {data}: {_prompts(train_set)}{evals}",
            f"rewards  {shown}",
            *([f"agents   {agents.describe()}"] if agents else []),
            f"engine   {engine.name} ({engine.reason})"
            + (f"; rollouts from vLLM ({cfg.vllm_mode})" if cfg.use_vllm else ""),
            f"device   {device}",
            f"passes   {passes}",
            f"rollouts {rollouts}",
            f"steps    {total_steps} optimizer steps from step {step}; rollouts of {layout.prompts_per_rollout} prompts "
            f"x {cfg.num_generations} completions, each feeding {layout.rollout_steps} step(s) of "
            f"{layout.step_completions} completions",
            f"output   {cfg.output_dir}"]


def end_lines(step: int, last: dict[str, float], seconds: float, failures: list[str], output_dir: str,
              vision: bool) -> list[str]:
    """What the run did: its steps and time, the last step's headline metrics, a line per kind of failure counted
    (rewards, health alarms), and where the final model is."""
    minutes, secs = divmod(int(round(seconds)), 60)
    shown = [k for k in ("reward/total", "eval/accuracy", "policy/kl_divergence") if k in last]
    metrics = ", ".join(f"{k} {last[k]:.3f}" for k in shown)
    auto = "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"
    return [f"done     {step} steps in {minutes}m{secs:02d}s" + (f"; {metrics}" if metrics else ""),
            *(f"WARNING  {line}" for line in failures),
            f"model    {output_dir}/final ({auto}.from_pretrained loads it)"]


def finish_run(out) -> None:
    """Draw the run's plot; a plot that fails is a warning, never a lost run."""
    try:
        from grpo.training.observe.plot import plot_run

        plot_run(out)
    except Exception as err:  # noqa: BLE001 - the model is saved already
        print(f"warning: could not draw the plot: {err}")
