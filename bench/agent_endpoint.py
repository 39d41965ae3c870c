"""The endpoint's cost: the calculator task trained through grpo's OpenAI-compatible endpoint (an agent of the
`openai` client as `Episodes`) against grpo's built-in tool loop, on the same engine, model, data and seeds, each
run in a process of its own, the sides alternating.

    python bench/agent_endpoint.py --steps 4 --rounds 2          # prints one JSON line; --markdown: a table too
    python bench/agent_endpoint.py --before 6489e61 --rounds 3   # and the endpoint as of a commit, interleaved
    python bench/agent_endpoint.py --model wider-512-4           # a larger random model (see wider_model)
    python bench/agent_endpoint.py --processes 1,2 --markdown    # and the agent's episodes in 1 and 2 processes

Sides: `loop`; `endpoint` (the sync agent, a thread an episode) and `endpoint_async` (one event loop), the episodes
in the trainer's process; with `--processes N`, `endpoint_pN` and `endpoint_async_pN`: the same agents with
`Episodes(processes=N)`, their episodes in N worker processes (grpo.agents.processes) while the endpoint and the
engine stay in the trainer's.

Both sides train the shipped tiny tools model (`recipes/calculator_tools.yaml`'s settings: 8 prompts x 8 completions,
128 completion tokens, at most 2 rounds of calculator calls). The agent does what the loop does: it sends the
conversation with the calculator's schema, runs the calls it gets back (the same exact calculator, in its own
process rather than in the loop's tool workers) and goes on, at most 2 rounds. A step's model tokens are the
tokens the model sampled (`completion/mean_length` x completions); generation tokens/s divides them by the step's
`time/generation` (the rollout: the loop's turns, or the episodes through the endpoint), steps/s by `time/step`;
tokens per CPU second divide them by the rollout's CPU time in the trainer's process and the episodes' workers.
The first `--warmup` steps of each run are not counted; figures are medians over the counted steps of all rounds,
and the load average is sampled before and after each run (the machine may be shared: report it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSET = str(ROOT / "grpo" / "assets" / "tiny-tools")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
ROUNDS_OF_CALLS = 2  # (max_tool_calling_iterations of the loop's side; --model wider: 0, one call an episode)


def episode(client, row) -> float:
    """The calculator task as an agent of the openai client, doing what the built-in loop does."""
    history = first_messages(row)
    for turn in range(ROUNDS_OF_CALLS + 1):
        message = client.chat.completions.create(model="policy", messages=history, tools=TOOLS).choices[0].message
        if not went_on(history, message, turn):
            break
    return float(f"<answer>{row['answer']}</answer>" in (history[-1].get("content") or ""))


async def async_episode(client, row) -> float:
    """`episode` for an AsyncOpenAI client (the episodes share one event loop instead of a thread each)."""
    history = first_messages(row)
    for turn in range(ROUNDS_OF_CALLS + 1):
        reply = await client.chat.completions.create(model="policy", messages=history, tools=TOOLS)
        if not went_on(history, reply.choices[0].message, turn):
            break
    return float(f"<answer>{row['answer']}</answer>" in (history[-1].get("content") or ""))


def first_messages(row) -> list[dict]:
    return [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else list(row["prompt"])


def went_on(history: list[dict], message, turn: int) -> bool:
    """Append the model's turn and, if it called the calculator within the rounds allowed, the answers (True)."""
    from grpo.agents.tools import calculator

    history.append(message.model_dump(exclude_none=True))
    if not message.tool_calls or turn == ROUNDS_OF_CALLS:
        return False
    for call in message.tool_calls:
        try:
            answer = calculator(**json.loads(call.function.arguments))
        except Exception as err:  # noqa: BLE001 - the model's bad call is answered, as the loop does
            answer = f"Error: {err}"
        history.append({"role": "tool", "tool_call_id": call.id, "content": str(answer)})
    return True


def wider_model(out: Path, hidden: int = 256, layers: int = 4) -> str:
    """A randomly initialised Qwen2 of `hidden` (MLP 4 x hidden) and `layers` with tiny-tools' tokenizer and chat
    template (256 x 4: 4.3M parameters, ~4x tiny-tools' cost a token): a turn that costs more to sample against the
    same per-request costs. It calls no tool (its `<tool_call>` is random), so both sides run with 0 rounds of
    calls."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = out / f"wider-{hidden}-{layers}"
    if not (path / "config.json").exists():
        config = AutoConfig.from_pretrained(ASSET)
        config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 4 * hidden, layers
        config.num_attention_heads = config.num_key_value_heads = 4
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        AutoTokenizer.from_pretrained(ASSET).save_pretrained(path)
    return str(path)


def run(side: str, steps: int, out: Path, seed: int, window_s: float, model: str = ASSET) -> list[dict]:
    """One training run of `side` ("loop", "endpoint": the sync agent, "endpoint_async", either with "_pN": in N
    worker processes); its per-step log."""
    from datasets import Dataset

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.agents import Episodes
    from grpo.tasks import calculator as task

    common = dict(output_dir=str(out / side), num_generations=8, prompts_per_step=8, per_device_train_batch_size=64,
                  max_completion_length=128, learning_rate=2e-4, beta=0.04, max_steps=steps, save_steps=0,
                  report_to=[], overwrite_output_dir=True, log_completions_steps=0, num_threads=1, temperature=1.0, seed=seed, eval_steps=0,
                  task_eval_size=0)
    dataset = Dataset.from_list(task.rows("train", 4000, seed=0))
    if side == "loop":
        args = GRPOConfig(task="calculator", tools=["calculator"], max_tool_calling_iterations=ROUNDS_OF_CALLS,
                          **common)
        trainer = GRPOTrainer(model=model, args=args, train_dataset=dataset)
    else:
        agent, _, processes = side.partition("_p")
        args = GRPOConfig(task=None, **common)
        trainer = GRPOTrainer(model=model, args=args, train_dataset=dataset, reward_funcs=[],
                              rollout_func=Episodes(async_episode if agent == "endpoint_async" else episode,
                                                    timeout_s=300, window_s=window_s,
                                                    processes=int(processes or 0)))
    cpu = rollout_cpu(trainer)
    trainer.train()
    log = [entry for entry in trainer.state.log_history if "time/step" in entry]
    return [{**entry, **c} for entry, c in zip(log, cpu)]


def rollout_cpu(trainer) -> list[dict]:
    """Per rollout: the CPU seconds this process and the episodes' worker processes spend in its generation (the
    loop's turns, or the episodes and the endpoint), of them this process's (the trainer's), and of those the
    engine's `generate` calls; filled as the run goes: on a shared machine the wall clock measures the load as much
    as the work. (The loop's tool processes are not counted: the calculator costs little.)"""
    cpu, generate, engine, sample = [], trainer.rollouts._generate, [0.0], trainer.generator.generate

    def engine_timed(*args, **kwargs):  # (in the calling thread: intra-op threads are 1)
        t0 = time.thread_time()
        try:
            return sample(*args, **kwargs)
        finally:
            engine[0] += time.thread_time() - t0

    def timed(request):
        t0, before, engine[0] = time.process_time(), workers_cpu(trainer), 0.0
        try:
            return generate(request)
        finally:
            trainer_cpu = time.process_time() - t0
            cpu.append({"cpu/generation": trainer_cpu + workers_cpu(trainer) - before, "cpu/trainer": trainer_cpu,
                        "cpu/engine": engine[0]})

    trainer.rollouts._generate, trainer.generator.generate = timed, engine_timed
    return cpu


def workers_cpu(trainer) -> float:
    """CPU seconds used so far by the live worker processes of the agent's episodes (Episodes(processes=N))."""
    workers = getattr(trainer.rollouts.agent, "workers", None)
    return workers.cpu_seconds() if workers is not None else 0.0


def figures(log: list[dict], warmup: int, completions: int) -> dict:
    counted = log[warmup:]
    tokens = [e["completion/mean_length"] * completions for e in counted]
    return {"steps": len(counted),
            "generation_tokens_per_s": statistics.median(t / e["time/generation"] for t, e in zip(tokens, counted)),
            # (all counted steps' tokens over their generation time: steadier than the median of a few steps when
            # the steps' lengths differ, as a random model's do; the sides sample the same tokens step by step)
            "generation_tokens_per_s_all": sum(tokens) / sum(e["time/generation"] for e in counted),
            "steps_per_s": statistics.median(1 / e["time/step"] for e in counted),
            "model_tokens_per_step": statistics.median(tokens),
            "generation_s": statistics.median(e["time/generation"] for e in counted),
            "generation_cpu_s": statistics.median(e["cpu/generation"] for e in counted),
            "tokens_per_cpu_s": statistics.median(t / e["cpu/generation"] for t, e in zip(tokens, counted)),
            "trainer_cpu_s": statistics.median(e["cpu/trainer"] for e in counted),
            "trainer_cpu_outside_engine_s": statistics.median(e["cpu/trainer"] - e["cpu/engine"] for e in counted),
            "requests": statistics.median(e.get("episodes/model_calls", 0) for e in counted),
            "step_s": statistics.median(e["time/step"] for e in counted)}


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the warm-up included)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, each round in another order")
    parser.add_argument("--window-s", type=float, default=0.05, help="the endpoint's batching window")
    parser.add_argument("--out", default="/tmp/grpo-bench-agent-endpoint")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--model", default="tiny-tools", help="tiny-tools, or wider-H-L: a random model of hidden "
                        "H and L layers, one call an episode (see wider_model); wider is wider-256-4")
    parser.add_argument("--processes", default="", help="comma-separated N: also the endpoint's sides with the "
                        "episodes in N worker processes (endpoint_pN, endpoint_async_pN)")
    parser.add_argument("--sides", default="", help="comma-separated: run only these sides (the loop always)")
    parser.add_argument("--before", metavar="REV", help="also run the endpoint's sides with grpo as of git "
                        "revision REV (extracted with git archive), interleaved with the rest")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a child: run this side, print its log)
    parser.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.processes = [int(n) for n in args.processes.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--processes: comma-separated integers >= 1, got {args.processes!r}")
    if any(n < 1 for n in args.processes):
        parser.error(f"--processes: each N >= 1, got {args.processes}")
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    if args.model == "wider":
        args.model = "wider-256-4"
    if args.model != "tiny-tools" and not re.fullmatch(r"wider-\d+-\d+", args.model):
        parser.error(f"--model: tiny-tools or wider-H-L, got {args.model!r}")
    return args


def child(args) -> None:
    """One run of one side in this process, with grpo imported from `args.tree`; prints its per-step log."""
    global ROUNDS_OF_CALLS
    sys.path.insert(0, args.tree)
    logging.basicConfig(level=logging.WARNING)
    model = ASSET
    if args.model != "tiny-tools":
        hidden, layers = map(int, args.model.split("-")[1:])
        ROUNDS_OF_CALLS, model = 0, wider_model(Path(args.out), hidden, layers)
    label = args.one + ("@before" if args.tree != str(ROOT) else "")
    log = run(args.one, args.steps, Path(args.out) / f"seed{args.seed}" / label, args.seed, args.window_s, model)
    print(json.dumps(log))


def before_tree(rev: str, out: Path) -> str:
    """grpo's files as of `rev`, extracted under `out` (git archive: the repository is not touched)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    tree = out / f"tree-{commit}"
    if not (tree / "grpo").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "grpo"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return str(tree)


def main(argv=None) -> dict:
    args = parse(argv)
    if args.one:
        return child(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sides = [("loop", str(ROOT)), ("endpoint", str(ROOT)), ("endpoint_async", str(ROOT))]
    sides += [(f"{agent}_p{n}", str(ROOT)) for n in args.processes for agent in ("endpoint", "endpoint_async")]
    if args.sides:
        wanted = {"loop", *args.sides.split(",")}
        unknown = wanted - {side for side, _ in sides}
        if unknown:
            raise SystemExit(f"--sides: no side {sorted(unknown)}; sides: {[side for side, _ in sides]}")
        sides = [(side, tree) for side, tree in sides if side in wanted]
    if args.before:
        tree = before_tree(args.before, Path(args.out))
        sides += [("endpoint", tree), ("endpoint_async", tree)]
    names = [side + ("@before" if tree != str(ROOT) else "") for side, tree in sides]
    logs: dict[str, list[dict]] = {name: [] for name in names}
    loads, started = [os.getloadavg()[0]], time.time()
    for r in range(args.rounds):
        for k in [*range(r % len(sides), len(sides)), *range(r % len(sides))]:  # (each round starts further on)
            side, tree = sides[k]
            command = [sys.executable, str(Path(__file__).resolve()), "--one", side, "--tree", tree, "--seed", str(r),
                       "--steps", str(args.steps), "--window-s", str(args.window_s), "--out", args.out,
                       "--model", args.model]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
            if done.returncode != 0:
                raise SystemExit(f"{names[k]} (round {r}) failed:\n{done.stderr[-3000:]}")
            logs[names[k]] += json.loads(done.stdout.strip().splitlines()[-1])[args.warmup:]
            loads.append(os.getloadavg()[0])
    result = {name: figures(log, 0, 64) for name, log in logs.items()}
    result["ratio"] = {f"{name}/loop": {key: result[name][key] / result["loop"][key]
                                        for key in ("generation_tokens_per_s", "generation_tokens_per_s_all",
                                                    "tokens_per_cpu_s", "steps_per_s")}
                       for name in names[1:]}
    result["load"] = {"loadavg_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
                      "cpus": os.cpu_count(), "threads": 1, "model": args.model,
                      "wall_s": round(time.time() - started, 1)}
    print(json.dumps(result))
    if args.markdown:
        print("| side | generation tokens/s | x loop | all steps' tokens / generation s | x loop | tokens / CPU s | "
              "x loop | steps/s | model tokens / step | generation s / step | s / step | trainer's CPU s / step "
              "(outside the engine) |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name in names:
            f, ratio = result[name], result["ratio"].get(f"{name}/loop", {})
            print(f"| {name} | {f['generation_tokens_per_s']:.0f} | {ratio.get('generation_tokens_per_s', 1):.2f} | "
                  f"{f['generation_tokens_per_s_all']:.0f} | {ratio.get('generation_tokens_per_s_all', 1):.2f} | "
                  f"{f['tokens_per_cpu_s']:.0f} | {ratio.get('tokens_per_cpu_s', 1):.2f} | {f['steps_per_s']:.3f} | "
                  f"{f['model_tokens_per_step']:.0f} | {f['generation_s']:.2f} | {f['step_s']:.2f} | "
                  f"{f['trainer_cpu_s']:.2f} ({f['trainer_cpu_outside_engine_s']:.2f}) |")
    return result


if __name__ == "__main__":
    main()
