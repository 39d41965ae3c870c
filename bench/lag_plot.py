"""Reward against wall time for the default job at lags 0, 1 and 2, in one PNG (docs/async.md, bench/README.md).

    python -m bench.lag_plot --threads 2                  # runs `grpo train` at max_staleness 0, 1, 2, then draws
    python -m bench.lag_plot --lags 0,1 max_steps=30      # other lags; key=value overrides go to every run
    python -m bench.lag_plot --runs 0=DIR 1=DIR 2=DIR     # draw runs made before (nothing is run)

Each run is the default job's grpo side (bench.default_job's command and environment, with its `--threads`: N torch
threads at lag 0, N - 1 for a lagged trainer beside its one-thread worker), timed from the command's start: while it
runs, every row that reaches its metrics.jsonl is stamped with the seconds since then (`wall_times.json` in the run
directory), so the x axis holds imports, loading, evaluations and checkpoints, as a user waits for them. A run made
elsewhere has no stamps: its x axis is then the sum of its steps' `time/step` (said in the legend). The PNG goes to
bench/lag_plot.png unless `--out` says otherwise; the JSON line printed at the end has each run's wall seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.default_job import ROOT, command, environment, side_threads

STAMPS = "wall_times.json"
DEFAULT_OUT = Path(__file__).resolve().parent / "lag_plot.png"


def run_timed(lag: int, out: Path, overrides: list[str], threads: int | None, poll: float = 0.2) -> float:
    """`grpo train` of the default job at `lag` into `out`, stamped as `run_stamped` says; the command's seconds."""
    side = "grpo" if lag == 0 else f"grpo-lag{lag}"
    return run_stamped(command(side, out, overrides, threads), environment(side_threads(side, threads)), out,
                       f"bench.lag_plot: lag {lag}", poll)


def run_stamped(cmd: list[str], env: dict, out: Path, name: str, poll: float = 0.2) -> float:
    """Run a `grpo train` command whose output_dir is `out`, stamping each metrics row with the seconds since the
    command started (out/wall_times.json: [[step, seconds], ...]); returns the whole command's seconds. Its log
    goes beside `out`; `name` says which run failed."""
    metrics, stamps, pending = out / "metrics.jsonl", [], ""
    log = out.parent / f"{out.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        reader = None  # metrics.jsonl, read from where the last poll stopped (the run's only cost to this process)
        while True:
            done = proc.poll() is not None
            now = time.perf_counter() - t0
            if reader is None and metrics.is_file():
                reader = open(metrics)
            if reader is not None:
                *lines, pending = (pending + reader.read()).split("\n")  # (complete lines only)
                stamps += [[json.loads(line)["step"], now] for line in lines]
            if done:
                break
            time.sleep(poll)
    if reader is not None:
        reader.close()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); end of {log}:\n" + log.read_text()[-3000:])
    (out / STAMPS).write_text(json.dumps(stamps))
    print(f"[{name}] {seconds:.1f} s", file=sys.stderr, flush=True)
    return seconds


def reward_by_time(run: Path) -> tuple[list[float], list[float], bool]:
    """(seconds, reward/total) of a run's rollout rows, and whether the seconds are wall-clock stamps (else the
    running sum of time/step)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stamped = (run / STAMPS).is_file()
    if stamped:
        when = dict((step, seconds) for step, seconds in json.loads((run / STAMPS).read_text()))
    else:
        when, total = {}, 0.0
        for row in rows:
            total += row.get("time/step", 0.0)
            when[row["step"]] = total
    points = [(when[r["step"]], r["reward/total"]) for r in rows if "reward/total" in r and r["step"] in when]
    return [t for t, _ in points], [r for _, r in points], stamped


def draw(runs: dict, out: Path, label=lambda lag: f"max_staleness {lag}") -> Path:
    """One axis: each run's reward/total against seconds (raw, light, under its moving average); `label` names a
    run by its key (a lag)."""
    from matplotlib.figure import Figure

    from grpo.training.observe.plot import plot_smoothed

    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.subplots()
    stamped_all = True
    for i, (lag, run) in enumerate(sorted(runs.items())):
        seconds, rewards, stamped = reward_by_time(run)
        stamped_all &= stamped
        end = f", {seconds[-1]:.0f} s" if seconds else ""
        plot_smoothed(ax, seconds, rewards, label=f"{label(lag)}{end}", color=f"C{i}")
    ax.set_xlabel("seconds since the command started" if stamped_all else "seconds (sum of time/step where a run "
                  "has no wall stamps)")
    ax.set_ylabel("reward/total")
    ax.set_title("the default job: reward against wall time", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(out, dpi=110)
    return out


def parse_runs(items: list[str]) -> dict[int, Path]:
    runs = {}
    for item in items:
        lag, sep, path = item.partition("=")
        if not sep or not lag.isdigit() or not (Path(path) / "metrics.jsonl").is_file():
            raise SystemExit(f"bench.lag_plot: --runs {item!r}: give LAG=DIR, DIR a run directory with metrics.jsonl")
        runs[int(lag)] = Path(path)
    return runs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the default recipe, for every run")
    parser.add_argument("--lags", default="0,1,2", help="comma-separated max_staleness values (default 0,1,2)")
    parser.add_argument("--threads", type=int, default=None, help="as bench.default_job's --threads")
    parser.add_argument("--runs", nargs="*", default=None, metavar="LAG=DIR", help="draw these runs, run nothing")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "runs" / "lag_plot",
                        help="where the runs go (default bench/runs/lag_plot)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG (default bench/lag_plot.png)")
    args = parser.parse_args(argv)
    seconds = {}
    if args.runs is not None:
        runs = parse_runs(args.runs)
    else:
        lags = sorted({int(x) for x in args.lags.split(",") if x.strip()})
        if not lags or min(lags) < 0:
            parser.error("--lags: comma-separated integers >= 0")
        args.work_dir.mkdir(parents=True, exist_ok=True)
        runs = {lag: args.work_dir.resolve() / f"lag{lag}" for lag in lags}
        for lag, run in runs.items():
            if run.exists():
                raise SystemExit(f"bench.lag_plot: {run} exists; remove it or pass another --work-dir")
            seconds[lag] = run_timed(lag, run, args.overrides, args.threads)
    out = draw(runs, args.out)
    record = {"png": str(out), "wall_s": {f"lag{k}": v for k, v in seconds.items()}, "threads": args.threads,
              "overrides": args.overrides}
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
