"""Two processes (torch.distributed with gloo, on CPU) reach the weights of one process with the same global batch,
and so does DeepSpeed ZeRO-2 (its CPU backend). FSDP2 and ZeRO-3, which shard the weights: test_sharded.py.

Each process samples its share of the B*G completions; sampling seeds belong to rows, not processes, so both runs
see the same completions; rewards are gathered before group statistics, and the loss is a share of the global sum.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

RECIPE = """\
model_name_or_path: {model}
dataset_name: {data}
task: null
reward_funcs: ["rewards_for_tests:count_a"]
num_generations: 8
prompts_per_step: 4
per_device_train_batch_size: 8
max_completion_length: 8
learning_rate: 1.0e-2
beta: 0.04
max_steps: 3
save_steps: 0
report_to: []
log_completions_steps: 0
"""


def job(tmp_path, model_dir) -> dict:
    """Write the recipe and its data into tmp_path; returns the environment the runs take."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}\n"}) + "\n" for i in range(16)))
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(model=model_dir, data=data))
    # The tests' helpers, then this checkout (not whichever one an editable install points at).
    here = Path(__file__).parent
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]), "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, out, env, succeed=True, overrides=()) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args, "train", str(out.parent / "recipe.yaml"), f"output_dir={out}",
                             *overrides], env=env, capture_output=True, text=True, timeout=600)
    if succeed:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_two_processes_match_one(tmp_path, tiny_model_dir):
    env = job(tmp_path, tiny_model_dir)
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "grpo.cli"],
        tmp_path / "two", env)
    run(["-m", "grpo.cli"], tmp_path / "one", env)
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert_same_run(tmp_path / "one", tmp_path / "two", one, two)


def assert_same_run(dir_a, dir_b, a, b, grad_rel=1e-5):
    """Two runs of the recipe saw the same rewards, gradient norms and loss metrics (to float rounding) and reached
    the same weights. Only float summation order differs (all-reduce vs one batch, packed vs padded rows); Adam at
    lr 1e-2 turns rounding in a near-zero gradient into steps of up to 1e-2, so the weights agree to ~1e-4 (measured
    9e-5 with padded rows, 1.1e-4 packed) while a wrong gradient moves them by ~1e-2."""
    logs = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (dir_a, dir_b)]
    assert [r["reward/total"] for r in logs[0]] == [r["reward/total"] for r in logs[1]]
    for row_a, row_b in zip(*logs):
        assert row_a["train/grad_norm"] == pytest.approx(row_b["train/grad_norm"], rel=grad_rel)
        # The loss's metrics are over every process's rows: several processes log the one-process values (before
        # the fix, the main process's rows alone: a KL and entropy of half the batch).
        for key in ("policy/kl_divergence", "policy/entropy", "policy/clip_frac", "train/loss"):
            assert row_b[key] == pytest.approx(row_a[key], rel=1e-4, abs=1e-7), (key, row_a[key], row_b[key])
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 5e-4, diff


F32_EPS = 2.0 ** -23  # float32's spacing at 1.0 (torch.finfo(torch.float32).eps): one rounding is at most half of it
# Adam made linear in the gradient: with epsilon 1 far above |g| (a gradient norm of 0.3 over 30k weights), a step is
# lr * m / (sqrt(v) + 1) ~ lr * m, so a rounding difference in g moves the weights by lr times that difference. With
# epsilon 1e-8 a near-zero element's step is lr * g / |g|: its rounding noise becomes a step of up to lr, and the two
# runs' later steps start from weights 1e-4 apart, which no float argument bounds.
LINEAR_ADAM = ["adam_epsilon=1", "learning_rate=1"]


def assert_reordered_run(dir_a, dir_b, a, b, terms: int, steps: int):
    """Two runs of the recipe with LINEAR_ADAM that differ only in the order of their float32 sums (a gradient
    all-reduced over processes vs accumulated over micro-batches of one process). They must share the rewards
    exactly (the same completions: sampling seeds belong to rows), and each step's gradient norm and loss metrics to
    the rounding of `terms` summed terms: reordering a sum of n float32 terms changes it by about
    u * sqrt(n) (u = F32_EPS / 2, the roundings adding as a random walk), taken 16x (8 * F32_EPS * sqrt(n)), plus
    one unit in the sixth significant digit (metrics.jsonl's rounding). The weights, each step a linear function of
    such gradients, then differ by the rounding of their last additions: a few F32_EPS * max|w| per step."""
    logs = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (dir_a, dir_b)]
    assert [r["reward/total"] for r in logs[0]] == [r["reward/total"] for r in logs[1]]
    rel = 8 * F32_EPS * terms ** 0.5
    for row_a, row_b in zip(*logs):
        for key in ("train/grad_norm", "policy/kl_divergence", "policy/entropy", "train/loss"):
            x, y = row_a[key], row_b[key]
            logged = 10.0 ** (math.floor(math.log10(abs(x))) - 5) if x else 0.0  # (a unit of the 6th digit)
            scale = 1.0 if key == "train/loss" else abs(x)  # (the loss: a mean of advantages ~1, summing to ~0)
            assert abs(x - y) <= rel * scale + logged, (key, row_a["step"], x, y, rel)
    largest = max(w.abs().max().item() for w in a.values())
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 4 * F32_EPS * largest * steps, (diff, largest)


# (CI time: test_two_processes_match_one runs the two-process path; test_sequence_parallel.py per-process budgets)
@pytest.mark.slow
def test_two_padding_free_processes_with_token_budgets_match_one_padded_process(tmp_path, tiny_model_dir):
    """Each process packs its rows and fills micro-batches up to 24 tokens, so the two may need different numbers of
    them: both run the larger number (an all-reduce in each backward under DeepSpeed or FSDP needs both), and the
    weights are those of one process with padded rows in one batch."""
    env = job(tmp_path, tiny_model_dir)
    launched = run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m",
                    "grpo.cli"], tmp_path / "two", env, overrides=["max_tokens_per_micro_batch=24"])
    assert "padding-free (each prompt once per group" in launched.stdout
    run(["-m", "grpo.cli"], tmp_path / "one", env, overrides=["use_remove_padding=false",
                                                              "per_device_train_batch_size=32"])
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert_same_run(tmp_path / "one", tmp_path / "two", one, two)


DEEPSPEED = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: {stage}
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
mixed_precision: 'no'
num_machines: 1
num_processes: 1
machine_rank: 0
main_process_port: {port}
"""


def deepspeed(tmp_path, stage: int) -> list[str]:
    """The arguments that launch `grpo train` under DeepSpeed ZeRO-`stage`, one process (tests/accelerate_driver.py)."""
    (tmp_path / "ds.yaml").write_text(DEEPSPEED.format(stage=stage, port=free_port()))
    return ["-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "ds.yaml"),
            str(Path(__file__).parent / "accelerate_driver.py")]


# (CI time: DeepSpeed runs in CI through tests/test_sharded.py's ZeRO-3 cases)
@pytest.mark.slow
def test_deepspeed_matches_one_process(tmp_path, tiny_model_dir):
    """Under DeepSpeed ZeRO-2 (accelerate's config, DeepSpeed's CPU backend) the run reaches the plain run's weights:
    the 4 micro-batches of a step are one optimizer step (DeepSpeed's engine steps in backward unless told more
    micro-batches follow), its 'auto' micro-batch size and gradient clipping come from the recipe, and the logged
    gradient norm is the one the engine took, not 0."""
    pytest.importorskip("deepspeed")
    env = job(tmp_path, tiny_model_dir)
    run(deepspeed(tmp_path, stage=2), tmp_path / "ds", env)
    run(["-m", "grpo.cli"], tmp_path / "one", env)
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    ds = load_file(str(tmp_path / "ds" / "final" / "model.safetensors"))
    assert_same_run(tmp_path / "one", tmp_path / "ds", one, ds, grad_rel=1e-4)  # (the norm DeepSpeed's engine took)


TOOLS_RECIPE = """\
model_name_or_path: {model}
task: calculator
reward_funcs: ["math_accuracy", "rewards_for_tests:called_a_tool"]
task_train_size: 64
task_eval_size: 0
num_generations: 4
prompts_per_step: 4
per_device_train_batch_size: 8
max_completion_length: 128
engine: transformers
learning_rate: 1.0e-3
adam_epsilon: 1.0e-4
beta: 0.04
max_steps: 2
save_steps: 0
report_to: []
log_completions_steps: 0
"""


@pytest.mark.slow
def test_a_tool_run_on_two_processes_matches_one(tmp_path):
    """The shipped tiny-tools model calls its calculator (in each process's own worker processes): the two
    processes' rows together are the one process's trajectories, tool calls and rewards, and the weights agree.
    Calling the tool is rewarded, so groups differ in reward: where no group does, the gradient is float noise
    that Adam scales up to whole learning-rate steps (measured: 1.5e-3 apart). adam_epsilon 1e-4 for the same
    reason: with 1e-8, gradient entries near 0 (float noise of the all-reduce's summation order) still become
    steps of about lr (measured: 4e-4 apart on a few entries, grad norms equal to 2e-6 relative, every trajectory
    identical); with 1e-4 equal gradients give equal weights."""
    keys = ["reward/total", "tools/calls_per_completion", "tools/turns_per_completion", "tools/model_token_frac",
            "completion/mean_length"]
    logs = two_match_one(tmp_path, TOOLS_RECIPE, keys)
    assert all(row["tools/calls_per_completion"] > 0 for row in logs[0])  # the runs did call the tool


def two_match_one(tmp_path, recipe: str, keys: list[str]) -> list[list[dict]]:
    """`recipe` (formatted with the shipped tiny-tools model) run on 2 processes and on 1: the weights within 1e-4,
    the logged `keys` equal, the gradient norms within 1e-4 relative; the two runs' logs (one, two)."""
    model = Path(__file__).resolve().parents[1] / "grpo" / "assets" / "tiny-tools"
    env = job(tmp_path, model)
    (tmp_path / "recipe.yaml").write_text(recipe.format(model=model))
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "grpo.cli"],
        tmp_path / "two", env)
    run(["-m", "grpo.cli"], tmp_path / "one", env)
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-4
    logs = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("one", "two")]
    assert [[row[k] for k in keys] for row in logs[0]] == [[row[k] for k in keys] for row in logs[1]]
    for a, b in zip(*logs):
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    return logs


def test_the_cpu_ddp_config_launches_two_processes_with_every_gpu_hidden():
    """recipes/accelerate/ddp_cpu.yaml through accelerate's own launch decision: its multi-process launcher (torchrun)
    with 2 processes, and no GPU visible to them. Its earlier MULTI_CPU type went to accelerate 1.15's one-process
    launcher (MULTI_CPU starts several only through mpirun), so `accelerate launch` ran one process, silently."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / "ddp_cpu.yaml"
    args = launch_command_parser().parse_args(["--config_file", str(config), "-m", "grpo.cli", "train"])
    args, _, _ = _validate_launch_command(args)
    assert args.multi_gpu and not (args.cpu or args.use_deepspeed or args.use_fsdp)  # launch_command's torchrun branch
    env = prepare_multi_gpu_env(args)
    assert args.nproc_per_node == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == "-1,-1"  # (CUDA lists the devices before the first invalid id: none)
