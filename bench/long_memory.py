"""Peak memory of one update pass against completion length: plain, gradient checkpointing, activation offload and
Ulysses SP=2 (issue 32, item 2).

    python bench/long_memory.py --tokens 1024 4096 16384

One row of one completion (a 48-token prompt and the rest completion) through the 4-layer, 256-wide Qwen2 of
bench/sequence_parallel.py (4 heads, 2 key/value heads, vocabulary 300, float32, CPU), one forward and backward of the
update's loss, each run in a fresh process by `bench.sequence_parallel.run`:

    packed      the padding-free pass grpo runs on one process (one sequence: causal sdpa, no mask)
    checkpoint  the same with gradient checkpointing (every decoder layer, non-reentrant)
    offload     the same under activation offload (grpo.engines.offload); on a CPU nothing moves
    checkpoint_offload  both: the layers' inputs offloaded
    sp2         two processes (gloo), Ulysses, each holding half the tokens

Per process: `saved` (bytes of the distinct tensors autograd keeps, weights left out), `left` (of those, what offload
leaves on an accelerator: tensors under its 64 KiB floor; = saved for the other runs), `peak rise` (resident memory's
rise over the pass, temporaries included), and each per token of the row (not of the process's share). Timings are
not measured. The children run with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_): by default it
rises after large frees, and the memory of later tensors stays in the heap after they are freed, so the resident peak
counted what the pass had freed (checkpointing at 4k tokens: 314 MB against 136 MB with the threshold fixed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sequence_parallel import run  # noqa: E402

MODES = ("packed", "checkpoint", "offload", "checkpoint_offload", "sp2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**16)  # (the children inherit it: see the module docstring)
    print("| tokens | run | process | saved MB | left on device MB | peak rise MB | saved KB/token | "
          "left KB/token | peak KB/token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, tokens in enumerate(args.tokens):
        for mode in args.modes:
            for r in run(mode, tokens, 29750 + i, rows=1):
                print(json.dumps(r), file=sys.stderr)
                per = 1024 / r["tokens"]  # MB -> KB per token of the row (its prompt included)
                print(f"| {r['tokens']} | {mode} | {r['rank']} | {r['saved_mb']:.1f} | {r['left_mb']:.1f} | "
                      f"{r['peak_mb']:.1f} | {r['saved_mb'] * per:.1f} | {r['left_mb'] * per:.1f} | "
                      f"{r['peak_mb'] * per:.1f} |", flush=True)


if __name__ == "__main__":
    main()
