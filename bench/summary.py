"""From the sides' step records to the benchmark's JSON line: medians, tokens per second, ratios, the floor.

Pure functions of plain dicts (the records bench/child.py writes), so they are tested without running anything.
"""

from __future__ import annotations

import statistics

from bench.child import PHASES
from bench.flops import step_flops
from bench.workloads import REQUIREMENTS, Workload

# vllm: grpo with vLLM rollouts (use_vllm), in the environment vLLM needs; grpo_padded: grpo with padded passes
# (use_remove_padding=false), to measure what padding-free passes change
SIDES = ("grpo", "trl", "vllm", "grpo_padded")


def steady(records: list[dict], key: str, warmup: int) -> list[float]:
    """Values of `key` for every step after the first `warmup` steps of each run, all runs pooled."""
    return [v for r in records for v in r[key][warmup:]]


def update_times(records: list[dict], warmup: int, unit: str = "") -> list[float]:
    """Per steady step: the step's time minus its generation, scoring and log-prob parts (the optimizer updates,
    with their forward and backward passes, plus whatever else the loop does). unit: "" wall, "_cpu" CPU."""
    out = []
    for r in records:
        for i in range(warmup, len(r["step_s"])):
            out.append(r[f"step{unit}_s"][i] - sum(r[f"{p}{unit}_s"][i] for p in PHASES))
    return out


def split(records: list[dict], warmup: int, unit: str) -> dict[str, float]:
    """Median seconds of each phase, and of the rest of the step ("update")."""
    out = {p: statistics.median(steady(records, f"{p}{unit}_s", warmup)) for p in PHASES}
    out["update"] = statistics.median(update_times(records, warmup, unit))
    return out


def side_figures(records: list[dict], warmup: int, tokens_per_step: int | None) -> dict:
    """Median wall and CPU seconds per step and per phase, tokens per second and peak memory of one side's runs.

    tokens_per_step None (a ragged workload, whose steps generate different numbers of tokens): tokens per second
    are the steady steps' tokens over their seconds, and the mean tokens per step is reported."""
    walls, cpus = steady(records, "step_s", warmup), steady(records, "step_cpu_s", warmup)
    if not walls:
        raise ValueError(f"side_figures: no steady-state steps (warmup={warmup}); run more steps than the warm-up.")
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    threads = records[0]["threads"]
    tokens = steady(records, "completion_tokens", warmup)
    if tokens_per_step is None:
        rate, cpu_rate = sum(tokens) / sum(walls), sum(tokens) / sum(cpus)
    else:
        rate, cpu_rate = tokens_per_step / wall, tokens_per_step / cpu
    return {"s_per_step": wall, "tokens_per_s": rate, "completion_tokens_per_step": statistics.mean(tokens),
            "cpu_s_per_step": cpu, "tokens_per_cpu_s": cpu_rate,
            # CPU seconds used / (wall seconds x threads): well below a quiet run's value means that other
            # processes took the cores, and the wall figures of this run are not to be trusted.
            "cpu_util": statistics.median(c / (w * threads) for c, w in zip(cpus, walls)),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in records),
            "peak_gpu_mb": max((r.get("peak_gpu_mb") or 0 for r in records), default=0) or None,
            "setup_rss_mb": max(r["setup_rss_mb"] for r in records),
            "time_split_s": split(records, warmup, ""), "cpu_split_s": split(records, warmup, "_cpu"),
            "steady_steps": len(walls)}


def check_identical_work(records: list[dict], tokens_per_step: int) -> None:
    """Every step on every side must have generated exactly B x G x T completion tokens."""
    for r in records:
        wrong = [n for n in r["completion_tokens"] if n != tokens_per_step]
        if wrong:
            raise RuntimeError(f"check_identical_work: the {r['side']} side generated {wrong[0]} completion tokens in "
                               f"a step, expected {tokens_per_step}; the two sides did not do the same work.")


def summarize(w: Workload, records: dict[str, list[dict]], warmup: int, matmul: dict[str, float]) -> dict:
    """The benchmark's JSON record. `records` maps side -> its runs; a side with no runs gets null figures.

    matmul: {"gflops": fp32 GFLOP per wall second, "gflops_per_cpu_s": per CPU second}, measured in the same run.
    floor_s = the step's analytic FLOPs (bench/flops.py) / matmul["gflops"]; a side's floor_ratio = its seconds
    per step / floor_s (1.0 is the floor). The cpu_ variants divide CPU seconds by the CPU-second floor.
    """
    # A ragged workload's steps differ in work: no fixed token count, and no floor (it depends on every length).
    tokens = None if w.ragged else w.completion_tokens_per_step
    out = {"workload": w.name, "completion_tokens_per_step": tokens,
           "matmul_gflops": matmul["gflops"], "matmul_gflops_per_cpu_s": matmul["gflops_per_cpu_s"]}
    floor_s = floor_cpu_s = None
    if not w.ragged:
        flops = step_flops(w)
        floor_s = flops.total / (matmul["gflops"] * 1e9)
        floor_cpu_s = flops.total / (matmul["gflops_per_cpu_s"] * 1e9)
        out.update(floor_gflop=flops.total / 1e9, floor_s=floor_s, floor_cpu_s=floor_cpu_s,
                   floor_gflop_split={"generation": flops.generation / 1e9, "reference": flops.reference / 1e9,
                                      "update": flops.update / 1e9})
    figures = {}
    for side in SIDES:
        runs = records.get(side, [])
        if tokens is not None:
            check_identical_work(runs, tokens)
        figures[side] = side_figures(runs, warmup, tokens) if runs else None
    for side, fig in figures.items():
        for key in ("s_per_step", "tokens_per_s", "completion_tokens_per_step", "cpu_s_per_step",
                    "tokens_per_cpu_s", "cpu_util", "peak_rss_mb", "peak_gpu_mb", "setup_rss_mb", "time_split_s", "cpu_split_s",
                    "steady_steps"):
            out[f"{side}_{key}"] = fig and fig[key]
        out[f"{side}_floor_ratio"] = fig and floor_s and fig["s_per_step"] / floor_s
        out[f"{side}_cpu_floor_ratio"] = fig and floor_cpu_s and fig["cpu_s_per_step"] / floor_cpu_s
    both = figures["grpo"] is not None and figures["trl"] is not None
    out["speedup"] = out["grpo_tokens_per_s"] / out["trl_tokens_per_s"] if both else None
    out["cpu_speedup"] = out["grpo_tokens_per_cpu_s"] / out["trl_tokens_per_cpu_s"] if both else None
    out["memory_ratio"] = out["grpo_peak_rss_mb"] / out["trl_peak_rss_mb"] if both else None
    # vLLM rollouts against grpo's own engine on the same work: > 1 means the vLLM engine's steps are faster
    with_vllm = figures["grpo"] is not None and figures["vllm"] is not None
    out["vllm_speedup"] = out["vllm_tokens_per_s"] / out["grpo_tokens_per_s"] if with_vllm else None
    # padding-free passes against padded ones, both grpo: > 1 means the padding-free steps are faster
    padded = figures["grpo"] is not None and figures["grpo_padded"] is not None
    out["padded_speedup"] = out["grpo_tokens_per_s"] / out["grpo_padded_tokens_per_s"] if padded else None
    out["padded_memory_ratio"] = out["grpo_peak_rss_mb"] / out["grpo_padded_peak_rss_mb"] if padded else None
    out["requirements"] = requirements(w.name, out)
    return out


def requirements(name: str, out: dict) -> dict[str, bool | None]:
    """The issue's floors for this workload: "speedup >= 3.0" -> met (None when a figure is missing)."""
    met = {}
    for key, kind, bound in REQUIREMENTS.get(name, []):
        value = out.get(key)
        label = f"{key} {'>=' if kind == 'min' else '<='} {bound}"
        met[label] = None if value is None else (value >= bound if kind == "min" else value <= bound)
    return met
