"""The default job against TRL given the same work: wall time of the whole command, and held-out accuracy.

    python -m bench.default_job                       # grpo train, then TRL's run of the same work; one JSON line
    python -m bench.default_job --rounds 2            # A B, B A: drift of a shared machine falls on both sides
    python -m bench.default_job max_steps=30          # any override of the default recipe, given to both sides
    python -m bench.default_job --sides grpo,grpo-lag1,trl   # grpo with max_staleness 1 too (docs/async.md)

Each side is one command in a fresh process, timed from start to exit as a user would (imports, data, model,
training, saving): `grpo train [overrides]` with the default recipe, and `python -m bench.trl_default_job` (TRL's
`GRPOTrainer` with every setting copied from the same resolved recipe, the same prompts in the same order, grpo's
reward functions; see its docstring). One torch thread on each side (the recipe's `num_threads`; OMP and MKL too),
or with `--threads N` each side the same N threads of the machine: N torch threads for grpo and TRL, N - 1 for a
grpo-lagK trainer beside its one-thread worker (`--threads 2` on a 2-core machine: the issue's comparison).
Then each final model is scored by the same command, `grpo eval --model DIR --task arithmetic --n N --k K` (not
timed), whose accuracy averages K samples of each of N held-out problems; `*_accuracy_se` is its standard error
over problems. The JSON line: each side's wall and CPU seconds, its accuracy, and `speedup` = TRL's wall seconds /
grpo's (`cpu_speedup` the same of CPU seconds, which a busy machine distorts less). A side `grpo-lagK` is grpo with
`max_staleness=K` (a rollout worker process beside the trainer's: two processes of one thread each); the line then
has `grpo-lagK_*` keys and `lagK_speedup` = grpo's wall seconds / grpo-lagK's, `lagK_vs_trl` = TRL's / grpo-lagK's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("grpo", "trl")
LAG_SIDE = re.compile(r"grpo-lag([1-9][0-9]*)$")  # grpo with max_staleness K


def side_threads(side: str, threads: int | None) -> int | None:
    """The torch threads of the side's training process under `--threads N` (None: the recipe's, today's one): N for
    grpo at lag 0 and for TRL; N - 1 (at least 1) for grpo-lagK, whose rollout worker takes one thread of its own."""
    if threads is None:
        return None
    return max(1, threads - 1) if LAG_SIDE.match(side) else threads


def command(side: str, out: Path, overrides: list[str], threads: int | None = None) -> list[str]:
    own = side_threads(side, threads)
    overrides = [*overrides, *([f"num_threads={own}"] if own is not None else [])]
    if side == "grpo" or LAG_SIDE.match(side):
        lag = LAG_SIDE.match(side)
        return [sys.executable, "-m", "grpo.cli", "train", f"output_dir={out}", *overrides,
                *([f"max_staleness={lag.group(1)}"] if lag else [])]
    return [sys.executable, "-m", "bench.trl_default_job", "--out", str(out), *overrides]


def environment(threads: int | None = None) -> dict[str, str]:
    n = str(threads or 1)
    return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_side(side: str, work: Path, index: int, overrides: list[str], threads: int | None = None
             ) -> tuple[float, float]:
    """Run one side's whole command; returns its wall seconds and CPU seconds (user + system, all threads; on a
    machine others share, the CPU seconds of a one-thread run stay near what its wall time would be on a quiet one).
    The log goes to WORK/<side>-<index>.log."""
    out, log = work / f"{side}-{index}", work / f"{side}-{index}.log"
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as log_file:
        done = subprocess.run(command(side, out, overrides, threads), cwd=ROOT,
                              env=environment(side_threads(side, threads)), stdout=log_file,
                              stderr=subprocess.STDOUT, check=False)
    seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"bench.default_job: the {side} side failed (exit {done.returncode}); end of {log}:\n"
                         + log.read_text()[-3000:])
    print(f"[bench.default_job] {side} run {index}: {seconds:.1f} s, {cpu:.1f} CPU s", file=sys.stderr, flush=True)
    return seconds, cpu


def evaluate(model_dir: Path, n: int, k: int, work: Path) -> dict[str, float]:
    """`grpo eval` of a final model: accuracy over n x k samples and its standard error over the n problems."""
    report = work / f"eval-{model_dir.parent.name}.json"
    cmd = [sys.executable, "-m", "grpo.cli", "eval", "--model", str(model_dir), "--task", "arithmetic", "--n", str(n),
           "--k", str(k), "--json", str(report)]
    done = subprocess.run(cmd, cwd=ROOT, env=environment(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.default_job: grpo eval of {model_dir} failed:\n{done.stderr[-3000:]}")
    result = json.loads(report.read_text())
    per_problem = [sum(r["correct"]) / len(r["correct"]) for r in result["rows"]]
    se = statistics.stdev(per_problem) / len(per_problem) ** 0.5 if len(per_problem) > 1 else 0.0
    return {"accuracy": result["accuracy"], "accuracy_se": se, "format_rate": result.get("format_rate")}


def summarize(runs: dict[str, list[tuple[float, float]]], accuracy: dict[str, dict]) -> dict:
    """The JSON record: per side its median wall and CPU seconds (and every run's), its first run's eval; the
    ratios (`speedup` of wall times, `cpu_speedup` of CPU times)."""
    out: dict = {}
    for side in [*SIDES, *sorted(s for s in runs if LAG_SIDE.match(s))]:
        timed = runs.get(side, [])
        out[f"{side}_wall_s"] = statistics.median(w for w, _ in timed) if timed else None
        out[f"{side}_cpu_s"] = statistics.median(c for _, c in timed) if timed else None
        out[f"{side}_wall_s_runs"] = [w for w, _ in timed]
        for key in ("accuracy", "accuracy_se", "format_rate"):
            out[f"{side}_{key}"] = accuracy.get(side, {}).get(key)
    both = out["grpo_wall_s"] is not None and out["trl_wall_s"] is not None
    out["speedup"] = out["trl_wall_s"] / out["grpo_wall_s"] if both else None
    out["cpu_speedup"] = out["trl_cpu_s"] / out["grpo_cpu_s"] if both else None
    if both and out["grpo_accuracy"] is not None and out["trl_accuracy"] is not None:
        gap = out["grpo_accuracy"] - out["trl_accuracy"]
        noise = (out["grpo_accuracy_se"] ** 2 + out["trl_accuracy_se"] ** 2) ** 0.5
        out["accuracy_gap"], out["accuracy_gap_se"] = gap, noise
        out["same_accuracy"] = abs(gap) <= 2 * noise  # within two standard errors of the difference
    for side in sorted(s for s in runs if LAG_SIDE.match(s) and runs[s]):
        lag_wall = out[f"{side}_wall_s"]
        name = side.removeprefix("grpo-")
        out[f"{name}_speedup"] = out["grpo_wall_s"] / lag_wall if out["grpo_wall_s"] is not None else None
        out[f"{name}_vs_trl"] = out["trl_wall_s"] / lag_wall if out["trl_wall_s"] is not None else None
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the default recipe, for both sides")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating (default 1)")
    parser.add_argument("--sides", default="grpo,trl", help="comma-separated: grpo, trl, grpo-lagK (grpo with "
                        "max_staleness=K) (default: grpo,trl)")
    parser.add_argument("--threads", type=int, default=None, help="give each side N threads of the machine: "
                        "torch threads N for grpo and TRL, N - 1 for grpo-lagK's trainer beside its one-thread "
                        "worker (default: the recipe's num_threads, 1)")
    parser.add_argument("--eval-n", type=int, default=500, help="held-out problems to score (default 500)")
    parser.add_argument("--eval-k", type=int, default=4, help="samples per problem (default 4)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep runs, logs and evals here")
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    if any(s not in SIDES and not LAG_SIDE.match(s) for s in sides) or not sides:
        parser.error(f"--sides: choose from {', '.join(SIDES)}, grpo-lagK (K >= 1)")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads: must be >= 1")
    with tempfile.TemporaryDirectory(prefix="grpo-default-job-") as tmp:
        work = (args.work_dir or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        runs: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                runs[side].append(run_side(side, work, r, args.overrides, args.threads))
        accuracy = {side: evaluate(work / f"{side}-0" / "final", args.eval_n, args.eval_k, work) for side in sides}
    out = {**summarize(runs, accuracy), "overrides": args.overrides, "rounds": args.rounds, "threads": args.threads,
           "eval_n": args.eval_n, "eval_k": args.eval_k, "load_average": os.getloadavg()[0]}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
