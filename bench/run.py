"""Benchmark `grpo` against TRL's GRPOTrainer on identical work; print one JSON line.

    python bench/run.py --workload W1|W2|W3|mini [--steps N] [--warmup W] [--rounds R] [--sides grpo,trl]

1. Writes the workload's randomly initialized model and tokenizer (bench/model_files.py) to a temporary directory.
2. Measures fp32 matrix-multiply throughput with the benchmark's thread count before the first run and after
   every run (the median reading sets the floor; the fastest gives *_floor_ratio_at_fastest).
3. Runs the sides alternately, each in a fresh process (bench/child.py), R rounds in the order A B, B A, A B, ...
   so that drift of the machine falls on both sides alike; each run trains W warm-up steps and N measured ones.
4. Prints the JSON record of bench/summary.py: medians over the R x N measured steps of each side.

Progress and the sides' logs go to stderr; the JSON line is the only thing on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `bench` and `grpo` importable from the checkout
    sys.path.insert(0, str(ROOT))

from bench.summary import SIDES, summarize
from bench.workloads import WORKLOADS


def matmul_throughput(threads: int, n: int = 1024, repeats: int = 10) -> dict[str, float]:
    """fp32 (n x n) @ (n x n) with `threads` threads: the best of `repeats` tries, in GFLOP per wall second and
    GFLOP per CPU second (all threads)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    wall = cpu = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        a @ b
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return {"gflops": 2 * n**3 / wall / 1e9, "gflops_per_cpu_s": 2 * n**3 / cpu / 1e9}


def run_side(side: str, args, model_dir: Path, work: Path, index: int) -> dict:
    """One run of one side in a fresh process; returns its record (bench/child.py)."""
    out, log = work / f"{side}-{index}.json", work / f"{side}-{index}.log"
    overrides = args.trl_set if side == "trl" else args.grpo_set
    python = args.vllm_python if side == "vllm" else sys.executable
    cmd = [str(python), "-m", "bench.child", side, "--workload", args.workload, "--model", str(model_dir),
           "--steps", str(args.warmup + args.steps), "--threads", str(args.threads), "--out", str(out),
           "--run-dir", str(work / f"run-{side}-{index}"), *(f"--set={o}" for o in overrides)]
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(log, "w") as log_file:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"bench/run.py: the {side} side failed (exit {done.returncode}); end of {log}:\n{tail}")
    record = json.loads(out.read_text())
    print(f"[bench] {side} run {index}: {time.perf_counter() - t0:.0f} s, steps "
          + " ".join(f"{s:.2f}" for s in record["step_s"]), file=sys.stderr, flush=True)
    return record


def order(sides: list[str], rounds: int) -> list[str]:
    """A B, B A, A B, ...: each side goes first in half of the rounds."""
    out = []
    for r in range(rounds):
        out += sides if r % 2 == 0 else sides[::-1]
    return out


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per run, not measured (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating (default 2)")
    parser.add_argument("--sides", default="grpo,trl",
                        help="comma-separated: grpo, trl (default: both), vllm (grpo with use_vllm), grpo_padded "
                             "(grpo with use_remove_padding=false)")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                        help="the Python of an environment with vLLM, for the vllm side (scripts/vllm_env.sh)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads on both sides (default: the CPUs this process may use)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the model, logs and records here (default: a temporary directory, deleted)")
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a grpo GRPOConfig setting (repeatable)")
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a TRL GRPOConfig setting, e.g. gradient_checkpointing=false (repeatable)")
    args = parser.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        parser.error(f"--sides: choose from {', '.join(SIDES)} (got {args.sides!r}).")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0.")
    if "vllm" in sides and not args.vllm_python.exists():
        parser.error(f"--vllm-python: {args.vllm_python} does not exist; build it with `bash scripts/vllm_env.sh`.")
    if "trl" in sides and importlib.util.find_spec("trl") is None:
        parser.error("--sides: TRL is not installed; `pip install -r bench/requirements.txt`, or pass --sides grpo.")
    args.sides = sides
    return args


def benchmark(args, work: Path) -> dict:
    from bench.model_files import write_model_dir

    workload = WORKLOADS[args.workload]
    model_dir = work / "model"
    params = write_model_dir(workload, model_dir)
    print(f"[bench] {workload.name}: {params:,} parameters, model in {model_dir}", file=sys.stderr, flush=True)
    load = [os.getloadavg()[0]]
    # The matmul throughput before and after every run: the machine's speed drifts by ~30% over minutes.
    throughput = [matmul_throughput(args.threads)]
    records: dict[str, list[dict]] = {side: [] for side in args.sides}
    for index, side in enumerate(order(args.sides, args.rounds)):
        records[side].append(run_side(side, args, model_dir, work, index))
        throughput.append(matmul_throughput(args.threads))
    load.append(os.getloadavg()[0])
    # The floor takes the median reading, as the seconds per step are medians over the same runs; the fastest
    # reading gives the floor ratios at the machine's best moment too (*_floor_ratio_at_fastest).
    typical = {key: statistics.median(t[key] for t in throughput) for key in throughput[0]}
    out = summarize(workload, records, args.warmup, typical)
    fastest_floor_s = out["floor_gflop"] / max(t["gflops"] for t in throughput) if "floor_gflop" in out else None
    for side in SIDES:
        step = out.get(f"{side}_s_per_step")
        out[f"{side}_floor_ratio_at_fastest"] = step / fastest_floor_s if step and fastest_floor_s else None
    out.update(parameters=params, threads=args.threads, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
               matmul_measured=throughput, load_average=load, versions=versions(args.sides),
               settings={side: {k: v for k, v in runs[0]["settings"].items() if k != "output_dir"}
                         for side, runs in records.items()})
    return out


def versions(sides: list[str]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", *(["trl"] if "trl" in sides else [])):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None, out=None) -> dict:
    """Run the benchmark; print its JSON line to `out` (default stdout) and return it."""
    args = parse_args(argv)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        result = benchmark(args, args.work_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
            result = benchmark(args, Path(tmp))
    print(json.dumps(result), file=out or sys.stdout, flush=True)
    return result


if __name__ == "__main__":
    # The JSON line is the only thing on stdout: everything else printed in this process, libraries' own logs
    # included (DeepSpeed, where installed, logs to stdout when transformers imports it), goes to stderr.
    json_line = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    main(out=json_line)
