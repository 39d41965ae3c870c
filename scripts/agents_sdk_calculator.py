"""The calculator task as an OpenAI Agents SDK agent (`pip install openai-agents`), trained through grpo's endpoint.

The agent is ordinary Agents SDK code: an `Agent` with a `calculator` function tool, run by `Runner.run` on an
`OpenAIChatCompletionsModel` whose client grpo hands to `episode`. The same `episode` evaluates (an `Endpoint` on the
model's weights) and trains (`GRPOTrainer(rollout_func=Episodes(episode))`):

    python scripts/agents_sdk_calculator.py --n 300 --steps 60 --out runs/sdk-calculator
    python scripts/agents_sdk_calculator.py --n 300 --steps 0                  # evaluate the shipped model only

It prints (and writes to OUT/result.json) the held-out accuracy before and after, on `--n` problems of the task's
test split, sampled at temperature 1 with fixed seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded

from grpo.agents.tools import calculator as exact_calculator

set_tracing_disabled(True)  # (the SDK would send traces to OpenAI)
ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "grpo" / "assets" / "tiny-tools"


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: The expression, e.g. "482 * 37".
    """
    return exact_calculator(expression)


async def episode(client, row) -> float:
    """One problem: the agent may call the calculator; its final answer is right or not."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="calculator", tools=[calculator], model=model, model_settings=ModelSettings())
    prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
    try:
        result = await Runner.run(agent, prompt, max_turns=3)
    except MaxTurnsExceeded:  # (it kept calling the tool: wrong; anything else raises, and grpo counts it)
        return 0.0
    return float(f"<answer>{row['answer']}</answer>" in str(result.final_output))


def evaluate(model_dir: str, n: int, seed: int = 1234) -> dict:
    """Held-out accuracy of `episode` on the model's weights, every problem through the endpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.agents import Endpoint
    from grpo.engines.base import SamplingParams
    from grpo.engines.sampling import TransformersSampler
    from grpo.tasks import calculator as task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = TransformersSampler(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    rows = task.rows("test", n, seed=0)
    endpoint = Endpoint(engine, tokenizer, SamplingParams(128, temperature=1.0))

    async def run_all():
        import openai

        endpoint.waiting = len(rows)

        async def one(i, row):
            key = endpoint.open_episode(seed + i, 128)
            client = openai.AsyncOpenAI(base_url=endpoint.episode_url(key), api_key="-", max_retries=0)
            try:
                return await episode(client, row), endpoint.close_episode(key)
            finally:
                endpoint.episode_ended()

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)), return_exceptions=True)

    with endpoint:
        results = asyncio.run(run_all())
    failed = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    called = [any(c.tool_calls for c in record.calls) for _, record in done]
    return {"accuracy": sum(r for r, _ in done) / n, "tool_call_rate": sum(called) / n, "n": n,
            "failed": len(failed), **({"first_failure": failed[0]} if failed else {})}


def train(out: str, steps: int) -> str:
    from datasets import Dataset

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.agents import Episodes
    from grpo.tasks import calculator as task

    args = GRPOConfig(output_dir=out, task=None, num_generations=8, prompts_per_step=8,
                      per_device_train_batch_size=64, max_completion_length=128, learning_rate=2e-4,
                      lr_scheduler_type="cosine", beta=0.04, max_steps=steps, save_steps=0, report_to=[],
                      log_completions_steps=10, num_threads=1, temperature=1.0, seed=0)
    trainer = GRPOTrainer(model=str(ASSET), args=args, reward_funcs=[],
                          train_dataset=Dataset.from_list(task.rows("train", 4000, seed=0)),
                          rollout_func=Episodes(episode, timeout_s=120))
    trainer.train()
    return str(Path(out) / "final")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/sdk-calculator")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    t0 = time.time()
    result = {"before": evaluate(str(ASSET), args.n)}
    if args.steps:
        final = train(args.out, args.steps)
        result["train_s"] = round(time.time() - t0, 1)
        result["after"] = evaluate(final, args.n)
    result["total_s"] = round(time.time() - t0, 1)
    print(json.dumps(result))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
