"""Time per generated token early and late in a long completion: does the sampler's per-token work grow with the
length? (issue 32, item 3)

    python bench/long_generation.py --tokens 8192

The 4-layer, 256-wide Qwen2 of bench/sequence_parallel.py (vocabulary 300, float32, CPU, one thread) samples 4 rows
with prompts of unequal length (left padding, so transformers' forward takes a padding mask at every step) and every
end token suppressed, so each row runs to the budget. Engines: `transformers` (TransformersSampler: transformers'
forward per token) and `cpu` (CPUSampler: the lean or compiled step). The time between two draws is one token's step;
printed: the median over the first 1,024 tokens and over the last 1,024, and their ratio. Attention over the cache
grows with the length by design (O(length) arithmetic per token); the rest should not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def timed(cls):
    """`cls` with a timestamp taken at every draw."""

    class Timed(cls):
        def _draw(self, logits, uniforms):
            self.stamps.append(time.perf_counter())
            return super()._draw(logits, uniforms)

    return Timed


def measure(engine: str, tokens: int, window: int) -> tuple[float, float]:
    """(median ms per token over the first `window` tokens, over the last `window`)."""
    import torch
    from ulysses_driver import tiny_model

    from grpo.engines.base import SamplingParams
    from grpo.engines.cpu.sampler import CPUSampler
    from grpo.engines.sampling import TransformersSampler

    torch.set_num_threads(1)
    model = tiny_model(2, layers=4, hidden=256, context=max(16384, 2 * tokens)).eval()
    sampler = timed(TransformersSampler if engine == "transformers" else CPUSampler)(model, 0, [])
    sampler.stamps = []
    prompts = [list(range(1, 1 + n)) for n in (40, 33, 26, 19)]
    sampler.generate(prompts, SamplingParams(tokens), seeds=[0, 1, 2, 3])
    steps = [1e3 * (b - a) for a, b in zip(sampler.stamps, sampler.stamps[1:])]
    return statistics.median(steps[:window]), statistics.median(steps[-window:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--engines", nargs="+", default=["transformers", "cpu"])
    args = parser.parse_args()
    print(f"| engine | ms/token, tokens 1-{args.window} | ms/token, last {args.window} of {args.tokens} | ratio |")
    print("|---|---|---|---|")
    for engine in args.engines:
        early, late = measure(engine, args.tokens, args.window)
        print(f"| {engine} | {early:.2f} | {late:.2f} | {late / early:.2f} |", flush=True)


if __name__ == "__main__":
    main()
