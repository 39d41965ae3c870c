"""What routing replay (R3) costs an MoE run: the routing record's memory and the update's time, R3 on against off.

    OMP_NUM_THREADS=1 python bench/moe_replay.py                       # tiny-moe on the arithmetic task, CPU
    python bench/moe_replay.py --model PATH --steps 6 --repeats 3      # another model

For each setting (router_replay off, then R3, alternating `--repeats` times so that a machine's drift falls on both),
`grpo train` runs `--steps` optimizer steps of one rollout each (num_iterations 2: the second pass over a rollout
is where R3 has something to force); the update's time per step (`time/update`, forward and backward of every
micro-batch) is read from metrics.jsonl, the first step left out (warm-up). The record's memory is that of the
rollout's routes: bytes per 1,000 tokens the rollout ran (prompt and completion), one uint8 per token x MoE layer x
chosen expert, and the same for the batch's padded (rows x (P+W)) layout the update slices micro-batches from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def run(model: str, replay: str, steps: int, out: Path) -> list[float]:
    from grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), model_name_or_path=model, task="arithmetic", max_steps=steps,
                      num_generations=8, prompts_per_step=4, max_completion_length=48, num_iterations=2,
                      save_steps=0, report_to=[], log_completions_steps=0, disable_tqdm=True,
                      router_replay=replay, seed=0)
    trainer = GRPOTrainer(args=args)
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["time/update"] for r in rows if "time/update" in r][1:]


def record_bytes(model: str) -> dict[str, float]:
    """Bytes of the routing record per 1,000 tokens: as each row carries it, and in the batch's padded layout."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config.base import shipped_model
    from grpo.engines import moe
    from grpo.engines.base import SamplingParams
    from grpo.engines.sampling import TransformersSampler
    from grpo.tasks import get_task

    path = shipped_model(model)
    policy, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    rows = get_task("arithmetic").dataset("train", n=32, seed=0)
    prompts = [tok(p + "<think>", add_special_tokens=False)["input_ids"] for p in rows["prompt"]]
    sampler = TransformersSampler(policy, tok.pad_token_id, [tok.eos_token_id])
    sampler.routes = moe.RouteRecorder(policy)
    out = sampler.generate(prompts, SamplingParams(48), list(range(len(prompts))))
    tokens = sum(r.shape[0] for r in out.routes)
    per_row = sum(r.numel() * r.element_size() for r in out.routes)
    width = max(len(c) for c in out.ids)
    padded = moe.batch_routes(out.routes, [len(p) for p in prompts], max(map(len, prompts)),
                              max(map(len, prompts)) + width)
    return {"layers": len(moe.routers(policy)), "top_k": moe.routers(policy)[0].top_k, "tokens": tokens,
            "bytes_per_1k_tokens": 1000 * per_row / tokens,
            "padded_bytes_per_1k_tokens": 1000 * padded.numel() * padded.element_size() / tokens,
            "dtype": str(out.routes[0].dtype), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(record_bytes(args.model)))
    times: dict[str, list[float]] = {"off": [], "R3": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for replay in times:
                times[replay] += run(args.model, replay, args.steps, Path(tmp) / f"{replay}-{repeat}")
    for replay, values in times.items():
        print(f"router_replay={replay}: update {statistics.median(values):.3f} s/step median over {len(values)} "
              f"steps (min {min(values):.3f}, max {max(values):.3f})")
    print(f"R3 / off: {statistics.median(times['R3']) / statistics.median(times['off']):.3f}")


if __name__ == "__main__":
    main()
