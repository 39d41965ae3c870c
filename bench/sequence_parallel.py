"""Activation memory of one packed micro-batch's forward and backward, one process against Ulysses over two
(issue 32, item 1).

    python bench/sequence_parallel.py --tokens 4000 8000

For each token count, three runs in fresh processes on the same model and micro-batch (tests/ulysses_driver.py's:
4 rows, 4 attention heads, 2 key/value heads, here 4 layers 256 wide):

    packed    one process, the packed pass grpo runs today (transformers' sdpa, masked from the position ids)
    sp1       one process, the Ulysses attention function with a group of one (sdpa per packed sequence)
    sp2       two processes (torch.distributed.run, gloo), each holding half the tokens

and for each process: `saved` (bytes of the distinct tensors autograd keeps for backward, counted by a
saved-tensors hook: the activations proper) and `peak` (the resident memory's rise over the pass: ru_maxrss after
it minus the resident size before it, which includes temporaries, the mask and communication buffers). Prints one
JSON line per run and process and a table of the ratios. Timings are not measured.
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


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(mode: str, tokens: int, rows: int = 4) -> dict:
    """One forward and backward of the micro-batch of `rows` rows in this process (a process of the group for sp2).
    Modes `checkpoint`, `offload` and `checkpoint_offload` are the `packed` pass with gradient checkpointing,
    activation offload or both on (bench/long_memory.py); `left_mb` counts the saved bytes offload leaves on an
    accelerator (all of them for the other modes)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests"))
    from ulysses_driver import ONE_ROW, loss_of, micro_batch, tiny_model

    from grpo.engines.offload import ActivationOffload
    from grpo.engines.packing import pack
    from grpo.engines.policy import completion_logprobs
    from grpo.engines.ulysses import SequenceGroup, installed, sequence_parallel_logprobs

    model = tiny_model(2, layers=4, hidden=256, context=max(16384, 2 * tokens))
    if mode in ("checkpoint", "checkpoint_offload"):  # (transformers >= 5.23's name; the old one warns)
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    ids, mask, width = micro_batch(tokens, rows)
    packed = pack(ids, mask, width, ONE_ROW)
    real = mask[:, -width:].float()
    if mode == "sp2":
        dist.init_process_group("gloo")
        sp = SequenceGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    else:
        sp = SequenceGroup(None, 0, 1)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}  # storage -> bytes, of the tensors autograd keeps (weights and their views left out)
    left: dict[int, int] = {}  # the same, of those offload would leave on an accelerator
    offload = ActivationOffload(model) if mode in ("offload", "checkpoint_offload") else None

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
            if offload is None or not offload.eligible(t):
                left[storage.data_ptr()] = storage.nbytes()
        return t if offload is None else offload.pack(t)

    before = rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(keep, offload.unpack if offload else lambda t: t):
        if mode in ("packed", "checkpoint", "offload", "checkpoint_offload"):
            logp = completion_logprobs(model, ids, mask, width, 1.0, packed=packed)
            loss_of(logp, torch.zeros_like(logp), real).backward()
        else:
            with installed(model):
                logp = sequence_parallel_logprobs(model, packed, sp, 1.0)
                loss_of(logp, torch.zeros_like(logp), real).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"mode": mode, "tokens": packed.tokens, "rank": sp.rank, "saved_mb": sum(seen.values()) / 2**20,
            "left_mb": sum(left.values()) / 2**20, "peak_mb": peak / 2**20}


def run(mode: str, tokens: int, port: int, rows: int = 4) -> list[dict]:
    """`measure` in a fresh process (two under torch.distributed.run for sp2); one result per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    with tempfile.TemporaryDirectory() as tmp:
        launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
                  if mode == "sp2" else [sys.executable])
        subprocess.run([*launch, __file__, "--child", mode, str(tokens), str(rows), tmp], env=env, check=True)
        return [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4000, 8000])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, tokens, rows, out = args.child
        result = measure(mode, int(tokens), int(rows))
        Path(out, f"{mode}-{result['rank']}.json").write_text(json.dumps(result))
        return
    print("| tokens | run | process | saved MB | peak rise MB | saved / packed | peak / packed | saved / sp1 | "
          "peak / sp1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, tokens in enumerate(args.tokens):
        rows = {m: run(m, tokens, 29700 + i) for m in ("packed", "sp1", "sp2")}
        for mode, results in rows.items():
            for r in results:
                print(json.dumps(r), file=sys.stderr)
                base, one = rows["packed"][0], rows["sp1"][0]
                print(f"| {r['tokens']} | {mode} | {r['rank']} | {r['saved_mb']:.1f} | {r['peak_mb']:.1f} | "
                      f"{r['saved_mb'] / base['saved_mb']:.2f} | {r['peak_mb'] / base['peak_mb']:.2f} | "
                      f"{r['saved_mb'] / one['saved_mb']:.2f} | {r['peak_mb'] / one['peak_mb']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
