"""One side of the benchmark in its own process: `python -m bench.child grpo|trl --workload W --model DIR ...`.

A fresh process per run keeps the memory figure clean (its own peak resident set) and keeps TRL out of the
`grpo` process. The side trains for `--steps` rollout steps and writes one JSON record to `--out`:

    step_s            wall time from one step's end to the next one's (the first: from the first step's start),
                      so everything the training loop does between steps counts
    step_cpu_s        CPU seconds (all threads) the process used in the same span; with one thread it is the
                      step's time on an idle core even when other processes share the machine
    generation_s, scoring_s, logprobs_s   the parts of each step spent sampling, in the reward functions, and
                      computing no-grad log-probs (reference, old policy); `*_cpu_s`: the same in CPU seconds
    completion_tokens tokens generated in each step (must be B x G x T on both sides)
    peak_rss_mb       the process's peak resident set size at the end of the last step (before any final save)
    peak_gpu_mb       on a CUDA machine, the peak GPU memory torch allocated by then (None on the CPU)
    setup_rss_mb      resident set size when the first step starts (model, reference, optimizer, libraries)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

PHASES = ("generation", "scoring", "logprobs")


def rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc; 0 where unavailable)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def peak_gpu_mb() -> float | None:
    """Peak GPU memory torch allocated in this process so far, in MiB; None without CUDA."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def now() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads)."""
    return time.perf_counter(), time.process_time()


class StepClock:
    """Per-step wall and CPU times, phase times and counts. Phases are added to the open step; `end_step` closes it."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []  # now() at the first step's start and at every step's end
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.setup_rss_mb = 0.0
        self.peak_rss_mb = 0.0
        self.peak_gpu_mb: float | None = None
        self.threads = 0

    def begin(self) -> None:
        """Mark the start of the first step (later steps start where the previous one ended)."""
        if not self.marks:
            import torch

            self.marks.append(now())
            self.setup_rss_mb = rss_mb()
            self.threads = torch.get_num_threads()

    def add(self, key: str, value: float) -> None:
        self.begin()
        self.current[key] += value

    def end_step(self) -> None:
        self.begin()
        self.marks.append(now())
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)
        self.peak_rss_mb = peak_rss_mb()
        self.peak_gpu_mb = peak_gpu_mb()
        (w0, c0), (w1, c1) = self.marks[-2:]
        print(f"[bench.child] step {len(self.steps)}: {w1 - w0:.2f} s wall, {c1 - c0:.2f} s CPU, "
              f"peak RSS {self.peak_rss_mb:.0f} MiB", file=sys.stderr, flush=True)

    def record(self) -> dict:
        pairs = list(zip(self.marks, self.marks[1:]))
        out = {"step_s": [b[0] - a[0] for a, b in pairs], "step_cpu_s": [b[1] - a[1] for a, b in pairs],
               "completion_tokens": [int(s.get("completion_tokens", 0)) for s in self.steps],
               "peak_rss_mb": self.peak_rss_mb, "peak_gpu_mb": self.peak_gpu_mb, "setup_rss_mb": self.setup_rss_mb, "threads": self.threads}
        for phase in PHASES:
            out[f"{phase}_s"] = [s.get(phase, 0.0) for s in self.steps]
            out[f"{phase}_cpu_s"] = [s.get(f"{phase}_cpu", 0.0) for s in self.steps]
        return out


def timed(clock: StepClock, phase: str, func, count=None, when=None):
    """Wrap `func` so its wall and CPU time are added to `phase` of the open step (only calls where `when()` is
    true), and `count(result)` to the step's completion_tokens."""

    def wrapper(*args, **kwargs):
        if when is not None and not when():
            return func(*args, **kwargs)
        wall, cpu = now()
        result = func(*args, **kwargs)
        wall_end, cpu_end = now()
        clock.add(phase, wall_end - wall)
        clock.add(f"{phase}_cpu", cpu_end - cpu)
        if count is not None:
            clock.add("completion_tokens", count(result))
        return result

    return wrapper


def parse_overrides(items: list[str]) -> dict:
    """`key=value` pairs with YAML values (`gradient_checkpointing=false`, `per_device_train_batch_size=16`)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"bench.child: override {item!r} must look like key=value.")
        out[key.strip()] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description="Run one side of the benchmark (see bench/run.py).")
    parser.add_argument("side", choices=("grpo", "trl", "vllm", "grpo_padded"))
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--model", required=True, help="model directory written by bench/model_files.py")
    parser.add_argument("--steps", type=int, required=True, help="rollout steps to train")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--out", required=True, help="JSON record to write")
    parser.add_argument("--run-dir", required=True, help="the trainer's output directory")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="trainer setting key=value")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    workload = WORKLOADS[args.workload]
    overrides = parse_overrides(args.overrides)
    if args.side == "vllm":  # grpo with vLLM rollouts; a KV cache of 256 MiB holds any workload's step
        overrides = {"use_vllm": True, "vllm_gpu_memory_utilization": 0.1,
                     "vllm_engine_kwargs": {"kv_cache_memory_bytes": 256 << 20}, **overrides}
    if args.side == "grpo_padded":  # grpo with its passes on padded rows, as before padding-free passes
        overrides = {"use_remove_padding": False, **overrides}
    if args.side in ("grpo", "vllm", "grpo_padded"):
        from bench.side_grpo import train
    else:
        from bench.side_trl import train
    clock = StepClock()
    settings = train(workload, args.model, args.steps, args.run_dir, overrides, clock)
    record = {"side": args.side, "workload": workload.name, "settings": settings, **clock.record()}
    Path(args.out).write_text(json.dumps(record, default=str) + "\n")


if __name__ == "__main__":
    main()
