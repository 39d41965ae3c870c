"""The async gain where it exists: generation on hardware of its own (issue 42, docs/async.md).

    python -m bench.server_lag                                  # lag 0, 1, 2 against one server, lag 1 against two
    python -m bench.server_lag --sides lag0,lag1 max_steps=24 --eval-n 100 --eval-k 1   # a short try (minutes)

The layout of a cluster in miniature on a 2-core machine: `grpo vllm-serve` of the default job's model pinned to
core 0 (`taskset`, one OpenMP thread, vLLM's own thread binding set to that core), the trainer (`grpo train`) pinned
to core 1 with one torch thread, talking to the server over 127.0.0.1 (`vllm_mode: server`, weights pushed over a
gloo group). Each side `lagK` runs the job below with `max_staleness=K`; `lagK-Nservers` is the same against N
servers, all on the server's core (the protocol's cost, not more hardware). The servers start once (about a minute
each) and serve every side in turn; each trainer pushes its own weights first, so no side sees another's.

The job (`JOB`, then the command line's key=value overrides): the default job (tiny-arith on `arithmetic`, 8 prompts
x 8 completions a step, all weights trained, cosine schedule) at `beta=0` (TRL's default: no reference pass, which
would add to the trainer's half), 400 steps, no evaluation during training, and a completion budget of 128
(`--completion-length`; the model's answers end at EOS after about 22 tokens, so it changes little). A lag hides at
most the shorter of generation and the rest of the step, so a lag-0 step shrinks at most to
step / max(generation, step - generation) (`lag0_step_ceiling` in the JSON line), and the whole command less (its
start, about 20 s quiet, is not overlapped): 400 steps, not the default job's 300, to dilute that start. Short tries
at lag 0 looking for a job whose generation and update take comparable time (one server; the shared 2-core machine
at load 5-14, so the seconds swing by 3x between runs: read each run's own ratio; 2026-11-28):

| job at lag 0 (steps) | generation s a step | update s a step | step s | ceiling |
|---|---|---|---|---|
| the default job, full weights, 64 rows (8; 16; 16; 12) | 0.71; 0.53; 0.30; 0.40 | 1.07; 1.55; 0.44; 1.29 | 1.96; 2.25; 0.80; 1.96 | 1.57; 1.31; 1.60; 1.26 |
| full weights, 32 rows (`prompts_per_step=4`, 8) | 0.27 | 0.41 | 0.76 | 1.55 |
| full weights, 16 rows (8) | 0.20 | 0.31 | 0.62 | 1.48 |
| full weights, 128 rows (12) | 0.59 | 1.57 | 2.27 | 1.35 |
| LoRA r 16, lr 2e-3, 64 rows (8; 16; 16; 24) | 0.54; 0.30; 0.31; 0.46 | 0.54; 0.44; 0.64; 0.75 | 1.16; 0.82; 1.01; 1.42 | 1.86; 1.58; 1.44; 1.48 |

Nothing moved the ratio beyond the noise: fewer or more rows change generation as much as the update (vLLM's CPU
build samples each seeded row on its own), LoRA's adapters add to the forward about what they save in the backward
on a model this small (run back to back with the full job at the quietest moment: 0.30 / 0.44 s both; it learns
as fast, 150 steps at lag 0 took held-out accuracy 0.263 -> 0.455 over 200 x 2), and a harder
task (`task_difficulty=3`) gave answers no longer (21 tokens) and rewards near 0.09. (256 rows in one request, and
the 200-problem evaluation at difficulty 3, failed in vLLM's CPU build: "CPU Generator does not use offset", a
seeded row whose prompt is prefilled in chunks.) So the job stays the default one, whose learning is known (held-out
0.23 -> 0.47 in 300 steps, bench/README.md), and the ratio measured on the quiet machine decides what lag 1 can
reach: at generation 0.6-0.7x the update a ceiling of about 1.6x on steps. Length: three server starts (about a
minute each), four runs of 400 steps, four held-out evaluations of 500 x 4 (the torch sampler, seconds each): about
15-25 minutes on a quiet 2-core machine.

Each side is timed as a user waits for it: the whole `grpo train` command, from start to exit (imports, data, model,
checkpoints, final/), with the server already up. Its final model is scored by `grpo eval --task arithmetic` (not
timed; bench.default_job.evaluate: accuracy over N x K samples and its standard error over problems). The JSON
line printed at the end: each side's wall seconds, accuracy and median step phases (`generation_s`, `update_s`,
`step_s`), `<side>_speedup` = lag 0's wall seconds / the side's, `<side>_same_accuracy` (within two standard errors
of lag 0's) and `lag0_step_ceiling`. The reward-against-time plot of every side goes to `--plot`
(bench/server_lag.png). Runs, logs and the servers' logs stay in `--work-dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.default_job import ROOT, environment, evaluate
from bench.lag_plot import draw, run_stamped

SIDE = re.compile(r"lag([0-9]+)(?:-([1-9][0-9]*)servers)?$")
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_side(side: str) -> tuple[int, int]:
    """(max_staleness, servers) of a side name: lagK or lagK-Nservers."""
    match = SIDE.match(side)
    if match is None:
        raise SystemExit(f"bench.server_lag: --sides {side!r}: name sides lagK or lagK-Nservers (e.g. lag1-2servers)")
    return int(match.group(1)), int(match.group(2) or 1)


def pinned(cores: str, threads: int = 1) -> dict[str, str]:
    """The environment of a process pinned to `cores` with `threads` OpenMP threads (vLLM's CPU build binds its
    own threads unless told where: VLLM_CPU_OMP_THREADS_BIND)."""
    return {**environment(threads), "VLLM_CPU_OMP_THREADS_BIND": cores}


@contextlib.contextmanager
def servers(count: int, model: str, core: str, python: Path, work: Path, memory: int):
    """`count` servers of `model`, each `taskset -c core`, up and answering /health: their URLs; stopped after."""
    procs, urls = [], []
    try:
        for i in range(count):
            port = free_port()
            log = open(work / f"server-{i}.log", "w")
            procs.append(subprocess.Popen(
                ["taskset", "-c", core, str(python), "-m", "grpo.cli", "vllm-serve", "--model", model, "--host",
                 "127.0.0.1", "--port", str(port), "--dtype", "float32", "--set", "enforce_eager=true",
                 "--set", f"kv_cache_memory_bytes={memory}"], cwd=ROOT, env=pinned(core), stdout=log,
                stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url, i in zip(procs, urls, range(count)):
            wait_healthy(proc, url, work / f"server-{i}.log")
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=120)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench.server_lag: the server at {url} exited ({proc.returncode}); end of {log}:\n"
                             + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2.0)
    raise SystemExit(f"bench.server_lag: the server at {url} did not answer within {timeout:g} s (see {log})")


# The job every side runs: the default job's recipe with these keys (the module docstring says why), then the
# command line's key=value overrides.
JOB = ("beta=0", "max_steps=400", "eval_steps=0")


def train_command(lag: int, urls: list[str], out: Path, overrides: list[str], core: str,
                  completion_length: int) -> list[str]:
    """`grpo train` of the benchmark's job against `urls` at `lag`, pinned to `core` with one torch thread."""
    return ["taskset", "-c", core, sys.executable, "-m", "grpo.cli", "train", f"output_dir={out}", "num_threads=1",
            f"max_completion_length={completion_length}", "use_vllm=true", "vllm_mode=server",
            f"vllm_server_base_url={','.join(urls)}", "vllm_server_timeout=600", f"vllm_group_port={free_port()}",
            f"max_staleness={lag}", *JOB, *overrides]


def phases(run: Path) -> dict[str, float]:
    """The median seconds a step of `run` spent generating (the server's reply, as the trainer waited for it at
    lag 0) and in the update and in the whole step, over its steps after the first (metrics.jsonl)."""
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "time/update" in r][1:]
    return {name: statistics.median(r[key] for r in rows) for name, key in
            (("generation_s", "time/generation"), ("update_s", "time/update"), ("step_s", "time/step"))} if rows else {}


def summarize(seconds: dict[str, float], scores: dict[str, dict], steps: dict[str, dict] | None = None) -> dict:
    """Each side's wall seconds and held-out accuracy; its speedup over lag0 and whether its accuracy is lag0's
    within two standard errors of the difference. With each side's `phases` (`steps`): their medians, and lag 0's
    ceiling on steps, step / max(generation, step - generation): what a lag gains at most when generation runs on
    its own core beside the rest of the step."""
    out: dict = {}
    for side, wall in seconds.items():
        out[f"{side}_wall_s"] = wall
        out.update({f"{side}_{k}": v for k, v in scores.get(side, {}).items()})
        out.update({f"{side}_{k}": v for k, v in (steps or {}).get(side, {}).items()})
    lag0 = (steps or {}).get("lag0")
    if lag0:
        out["lag0_step_ceiling"] = lag0["step_s"] / max(lag0["generation_s"], lag0["step_s"] - lag0["generation_s"])
    base = "lag0" if "lag0" in seconds else None
    for side in seconds:
        if base is None or side == base:
            continue
        out[f"{side}_speedup"] = seconds[base] / seconds[side]
        if side in scores and base in scores:
            gap = scores[side]["accuracy"] - scores[base]["accuracy"]
            noise = (scores[side]["accuracy_se"] ** 2 + scores[base]["accuracy_se"] ** 2) ** 0.5
            out[f"{side}_same_accuracy"] = abs(gap) <= 2 * noise
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the job (the default recipe and JOB), "
                        "for every side")
    parser.add_argument("--sides", default="lag0,lag1,lag2,lag1-2servers", help="comma-separated lagK or "
                        "lagK-Nservers (default lag0,lag1,lag2,lag1-2servers)")
    parser.add_argument("--completion-length", type=int, default=128, help="max_completion_length (default 128)")
    parser.add_argument("--server-core", default="0", help="the cores of every server (taskset -c; default 0)")
    parser.add_argument("--trainer-core", default="1", help="the trainer's cores (taskset -c; default 1)")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="the Python that has vLLM "
                        "(default .venv-vllm/bin/python: bash scripts/vllm_env.sh)")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="each server's KV cache (256 MiB)")
    parser.add_argument("--eval-n", type=int, default=500, help="held-out problems to score (default 500)")
    parser.add_argument("--eval-k", type=int, default=4, help="samples per problem (default 4)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "runs" / "server_lag")
    parser.add_argument("--plot", type=Path, default=Path(__file__).resolve().parent / "server_lag.png")
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    shape = {side: parse_side(side) for side in sides}
    if not args.vllm_python.is_file():
        raise SystemExit(f"bench.server_lag: --vllm-python {args.vllm_python}: no such file (bash "
                         f"scripts/vllm_env.sh makes .venv-vllm)")
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if any((work / side).exists() for side in sides):
        raise SystemExit(f"bench.server_lag: {work} holds runs of these sides; remove them or pass another --work-dir")
    from grpo.config.base import DEFAULT_MODEL

    seconds, scores = {}, {}
    for count in sorted({n for _, n in shape.values()}):
        with servers(count, DEFAULT_MODEL, args.server_core, args.vllm_python, work, args.kv_cache_bytes) as urls:
            for side in [s for s in sides if shape[s][1] == count]:
                cmd = train_command(shape[side][0], urls, work / side, args.overrides, args.trainer_core,
                                    args.completion_length)
                seconds[side] = run_stamped(cmd, pinned(args.trainer_core), work / side, f"bench.server_lag {side}")
    for side in sides:
        scores[side] = evaluate(work / side / "final", args.eval_n, args.eval_k, work)
    record = {**summarize(seconds, scores, {side: phases(work / side) for side in sides}), "png": str(draw({s: work / s for s in sides}, args.plot,
                                                            label="{}".format)),
              "completion_length": args.completion_length, "job": [*JOB, *args.overrides]}
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
