"""Time per generated token early and late in a long completion: does the sampler's per-token work grow with the
length? (issue 32, item 3)

    python bench/long_generation.py --tokens 8192

The 4-layer, 256-wide Qwen2 of bench/sequence_parallel.py (vocabulary 300, float32, CPU, one thread) samples 4 rows
with prompts of unequal length (left padding, so transformers' forward takes a padding mask at every step) and every
end token suppressed, so each row runs to the budget. Engines: `transformers` (TransformersSampler: transformers'
forward per token) and `cpu` (CPUSampler: the lean or compiled step). The time between two draws is one token's step;
printed: the median over the first 1,024 tokens and over the last 1,024. Attention over the cache grows with the
length by design (O(length) arithmetic per token), so for the transformers engine the time inside the layers'
attention modules is taken apart (forward hooks) and the rest printed, which should not grow. The cpu engine's step
is one compiled call (attention included), shown whole.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def timed(cls, clock: list[float]):
    """`cls` with a timestamp and the attention time so far (`clock[0]`) taken at every draw."""

    class Timed(cls):
        def _draw(self, logits, uniforms):
            self.stamps.append((time.perf_counter(), clock[0]))
            return super()._draw(logits, uniforms)

    return Timed


def time_attention(model, clock: list[float]) -> None:
    """Add the time spent in each layer's attention module (projections, rotary, cache, sdpa) to clock[0]."""
    started = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
        layer.self_attn.register_forward_hook(lambda *_: clock.__setitem__(0, clock[0] + time.perf_counter()
                                                                             - started.pop()))


def measure(engine: str, tokens: int, window: int) -> list[float]:
    """Median ms per token over the first `window` tokens and over the last `window`, then the same of the time in
    the attention modules (0 for the cpu engine, whose step does not call them)."""
    import torch
    from ulysses_driver import tiny_model

    from grpo.engines.base import SamplingParams
    from grpo.engines.cpu.sampler import CPUSampler
    from grpo.engines.sampling import TransformersSampler

    torch.set_num_threads(1)
    model = tiny_model(2, layers=4, hidden=256, context=max(16384, 2 * tokens)).eval()
    clock = [0.0]
    time_attention(model, clock)
    sampler = timed(TransformersSampler if engine == "transformers" else CPUSampler, clock)(model, 0, [])
    sampler.stamps = []
    prompts = [list(range(1, 1 + n)) for n in (40, 33, 26, 19)]
    sampler.generate(prompts, SamplingParams(tokens), seeds=[0, 1, 2, 3])
    steps = [1e3 * (b[0] - a[0]) for a, b in zip(sampler.stamps, sampler.stamps[1:])]
    attention = [1e3 * (b[1] - a[1]) for a, b in zip(sampler.stamps, sampler.stamps[1:])]
    return [statistics.median(x) for x in (steps[:window], steps[-window:], attention[:window], attention[-window:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--engines", nargs="+", default=["transformers", "cpu"])
    args = parser.parse_args()
    print(f"| engine | ms/token, tokens 1-{args.window} | in attention | rest | ms/token, last {args.window} of "
          f"{args.tokens} | in attention | rest |")
    print("|---|---|---|---|---|---|---|")
    for engine in args.engines:
        early, late, early_attention, late_attention = measure(engine, args.tokens, args.window)
        print(f"| {engine} | {early:.2f} | {early_attention:.2f} | {early - early_attention:.2f} | {late:.2f} | "
              f"{late_attention:.2f} | {late - late_attention:.2f} |", flush=True)

if __name__ == "__main__":
    main()
