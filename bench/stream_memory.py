"""Peak memory of a streamed run against the number of rows in its data file (issue 23, item 3).

    python bench/stream_memory.py --rows 10000 1000000 [--steps 3] [--also-unstreamed]

For each row count: write a jsonl of that many arithmetic problems (the built-in task's generator), then run
`grpo train` on it with dataset_streaming=true (the shipped tiny model, the arithmetic task's rewards and prefill,
a 1,000-row shuffle buffer) in a child process, and print the child's peak resident memory (ru_maxrss). With
--also-unstreamed the same file is also run without streaming, for contrast. Timings are not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, n: int) -> None:
    from grpo.tasks import get_task

    task, chunk = get_task("arithmetic"), 100_000
    with path.open("w") as f:
        for start in range(0, n, chunk):
            part = task.dataset("train", n=min(chunk, n - start), seed=start)
            for row in part:
                f.write(json.dumps(row) + "\n")


def peak_rss_mib(args: list[str]) -> float:
    """Run `grpo train ARGS` in a child process; its peak RSS in MiB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import resource, sys\nfrom grpo.cli import main\nrc = main(['train'] + sys.argv[1:])\n"
            "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("PEAK_KIB")][-1]
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--also-unstreamed", action="store_true")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n in opts.rows:
            data = Path(tmp) / f"rows-{n}.jsonl"
            write_rows(data, n)
            common = [f"dataset_name={data}", "task=arithmetic", f"max_steps={opts.steps}", "save_steps=0",
                      "task_eval_size=0", "report_to=[]", "disable_tqdm=true"]
            modes = [("streamed", ["dataset_streaming=true"])]
            if opts.also_unstreamed:
                modes.append(("loaded whole", []))
            for name, extra in modes:
                mib = peak_rss_mib(common + extra + [f"output_dir={tmp}/run-{n}-{len(extra)}"])
                print(json.dumps({"rows": n, "file_mib": round(data.stat().st_size / 2**20, 1), "mode": name,
                                  "steps": opts.steps, "peak_rss_mib": round(mib, 1)}), flush=True)


if __name__ == "__main__":
    main()
