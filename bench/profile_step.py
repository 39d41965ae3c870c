"""Where the time of one `grpo` step goes: `python -m bench.profile_step --workload W2 [--warmup 1] [--threads 1]`.

`--workload default` profiles the default job (`grpo train`'s recipe, its model and task) instead.
Builds the workload's model, sets up grpo's trainer as the benchmark does (bench/side_grpo.py), runs the warm-up
steps, then one step in which each phase (sampling, the no-grad log-prob passes, the update) runs under torch's
operator profiler on its own. Prints, per phase, its wall time, the part spent inside torch operators (the rest is
Python and the loop), and the operators that took the most time (self time, so nested calls are not counted twice).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def profiled(func, name: str, tables: dict):
    """Wrap `func` so each call runs under torch's operator profiler; the call's wall time and operator table are
    appended to tables[name]."""
    from torch.profiler import ProfilerActivity, profile

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = func(*args, **kwargs)
        tables.setdefault(name, []).append((time.perf_counter() - t0, prof.key_averages()))
        return result

    return wrapper


def build_trainer(w, tmp: Path, steps: int):
    """grpo's trainer on workload w, set up as bench/side_grpo.py does."""
    from datasets import Dataset

    from bench.model_files import write_model_dir
    from bench.side_grpo import settings
    from bench.workloads import prompts, reward_vowels
    from grpo import GRPOConfig, GRPOTrainer

    write_model_dir(w, tmp / "model")
    cfg = GRPOConfig(**settings(w, steps, str(tmp / "run")))
    return GRPOTrainer(model=str(tmp / "model"), reward_funcs=[reward_vowels], args=cfg,
                       train_dataset=Dataset.from_dict({"prompt": prompts(w)}))


def default_trainer(tmp: Path, steps: int):
    """grpo's trainer on the default job (grpo/recipes/default.yaml), as `grpo train` sets it up."""
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.cli import DEFAULT_RECIPE
    from grpo.engines.cpu import native

    native.keep_freed_memory()  # as the `grpo` command does
    cfg = GRPOConfig.load(DEFAULT_RECIPE, [f"output_dir={tmp / 'run'}", f"max_steps={steps}", "report_to=[]"])
    return GRPOTrainer(args=cfg)


def profile_step(workload_name: str, warmup: int, threads: int, top: int) -> None:
    """Run `warmup` steps, then one step with each phase profiled on its own; print the tables."""
    import torch

    from bench.workloads import WORKLOADS

    torch.set_num_threads(threads)
    tables: dict = {}
    with tempfile.TemporaryDirectory(prefix="grpo-profile-") as tmp:
        if workload_name == "default":
            trainer = default_trainer(Path(tmp), warmup + 1)
        else:
            trainer = build_trainer(WORKLOADS[workload_name], Path(tmp), warmup + 1)
        for _ in range(warmup):
            trainer.train_step()
            trainer.step += 1
        trainer.generator.generate = profiled(trainer.generator.generate, "generation", tables)
        trainer._score_logprobs = profiled(trainer._score_logprobs, "logprobs", tables)
        trainer._optimize = profiled(trainer._optimize, "update", tables)  # (train_step's optimizer steps)
        t0 = time.perf_counter()
        trainer.train_step()
        step = time.perf_counter() - t0
    print(f"{workload_name}: one step after {warmup} warm-up, {threads} thread(s): {step:.2f} s "
          "(each phase under the profiler, whose overhead is included)")
    for name, calls in tables.items():
        wall = sum(t for t, _ in calls)
        events = calls[-1][1]
        ops = sum(e.self_cpu_time_total for e in events) / 1e6
        print(f"\n== {name}: {wall:.2f} s, of which torch operators {ops:.2f} s (the rest: Python and the loop)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=top))


def main(argv: list[str] | None = None) -> None:
    import os

    from bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS) + ["default"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--top", type=int, default=25, help="operators to list")
    args = parser.parse_args(argv)
    profile_step(args.workload, args.warmup, args.threads, args.top)


if __name__ == "__main__":
    main()
