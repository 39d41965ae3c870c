"""The seed tutorial's exercise (004, Tasks 4 and 5) and the supervision comparison, as reproducible experiments.

    python experiments/run.py --experiment num_generations   # G = 2, 8, 16, 32 (Task 4)
    python experiments/run.py --experiment format_weight     # format-reward weight 0, 0.1, 1.0 (Task 5)
    python experiments/run.py --experiment supervision       # outcome only, process only, mixed

Each variant trains the shipped tiny model on the built-in arithmetic task from the same seed for the same number
of steps and the same number of completions per step (prompts_per_step x num_generations is held at 64, so G=2
sees 32 prompts and G=32 sees 2), then the table is written to experiments/results/<experiment>.md and a plot of
held-out accuracy against step to experiments/results/<experiment>.png.

Columns: outcome advantage std (mean over steps; with process supervision the token advantages that are trained
on differ), seconds per step (median), final held-out accuracy (200 problems, sampled at temperature 1), and
stability: the largest KL to the reference and the std of the training accuracy over the last 20 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
COMPLETIONS_PER_STEP = 64

EXPERIMENTS = {
    "num_generations": [(f"G={g}", {"num_generations": g, "prompts_per_step": COMPLETIONS_PER_STEP // g})
                        for g in (2, 8, 16, 32)],
    "format_weight": [(f"format weight {w}", {"reward_funcs": ["math_accuracy", "think_format"],
                                              "reward_weights": [1.0, w]}) for w in (0.0, 0.1, 1.0)],
    "supervision": [
        ("outcome only", {}),
        ("process only", {"step_reward_funcs": ["arithmetic_steps"], "outcome_weight": 0.0}),
        ("mixed", {"step_reward_funcs": ["arithmetic_steps"], "outcome_weight": 1.0, "process_weight": 0.5}),
    ],
}


def run_variant(name: str, overrides: dict, out: Path, steps: int) -> dict:
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.cli import DEFAULT_RECIPE
    from grpo.training.observe.tracking import read_metrics

    values = {"max_steps": steps, "eval_steps": max(1, steps // 4), "save_steps": 0, "report_to": [],
              "log_completions_steps": 0, "output_dir": str(out), "beta": 0.04, **overrides}
    cfg = GRPOConfig.load(DEFAULT_RECIPE, [f"{k}={json.dumps(v)}" for k, v in values.items()])
    GRPOTrainer(args=cfg).train()
    rows = read_metrics(out)
    train = [r for r in rows if "reward/total" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    accuracy = [r["reward/math_accuracy"] for r in train[-20:]]
    return {"variant": name, "advantage_std": statistics.mean(r["advantage/std"] for r in train),
            "seconds_per_step": statistics.median(r["time/step"] for r in train),
            "final_accuracy": evals[-1][1], "max_kl": max(r.get("policy/kl_divergence", 0.0) for r in train),
            "accuracy_std_last20": statistics.pstdev(accuracy), "curve": evals}


def write(experiment: str, results: list[dict], steps: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    lines = [f"# {experiment}", "", f"`python experiments/run.py --experiment {experiment} --steps {steps}`", "",
             "| variant | outcome advantage std | s / step | final held-out accuracy | max KL | accuracy std (last 20) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['variant']} | {r['advantage_std']:.3f} | {r['seconds_per_step']:.2f} | "
                     f"{r['final_accuracy']:.3f} | {r['max_kl']:.4f} | {r['accuracy_std_last20']:.3f} |")
    (RESULTS / f"{experiment}.md").write_text("\n".join(lines) + "\n")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for r in results:
        ax.plot(*zip(*r["curve"]), marker="o", label=r["variant"])
    ax.set(xlabel="step", ylabel="held-out accuracy", title=experiment)
    ax.legend()
    fig.savefig(RESULTS / f"{experiment}.png", dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", choices=sorted(EXPERIMENTS), required=True)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--work-dir", default="runs/experiments")
    args = parser.parse_args()
    results = []
    for i, (name, overrides) in enumerate(EXPERIMENTS[args.experiment]):
        results.append(run_variant(name, overrides, Path(args.work_dir) / args.experiment / str(i), args.steps))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "curve"}))
    write(args.experiment, results, args.steps)


if __name__ == "__main__":
    main()
