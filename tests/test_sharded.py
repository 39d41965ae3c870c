"""FSDP2 and DeepSpeed ZeRO-3 on the CPU: 2 processes (gloo) under `accelerate launch`, through
tests/accelerate_driver.py (which lets accelerate see them as on a GPU machine; everything else is `grpo train`).

The job is test_distributed's (4 prompts x 8 completions, 8 rows per micro-batch: 2 micro-batches per process),
with num_iterations=2 and beta=0.04, 3 steps. Against one process on the same job (the transformers engine, as the
sharded runs take): the same rewards and gradient norms at every step and the same weights up to float32 rounding,
with LoRA too; each process holds about half the weights and optimizer state. Killed with SIGKILL mid-run, each
resumes to the uninterrupted run's weights exactly. Two "machines" (two launches, machine ranks 0 and 1 on
127.0.0.1) train exactly as one launch of 2 processes. Inside the processes (tests/sharded_checks.py): sampling is
collective-safe whether the weights are gathered or not, and an engine that keeps its own copy (vLLM) is handed
the weights one tensor at a time. With sequence_parallel_size=2 the 2 sharded processes (one SP group) reach the
one-process run too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from safetensors.torch import load_file

from test_distributed import free_port, job, run

try:
    import deepspeed  # noqa: F401
except ImportError:
    deepspeed = None
KINDS = ["fsdp2", pytest.param("zero3", marks=pytest.mark.skipif(deepspeed is None, reason="pip install deepspeed"))]
# (CI time: where FSDP2 covers the same path, the ZeRO-3 case runs in the slow tier; full-weight ZeRO-3 stays in CI)
SLOW_ZERO3 = pytest.param("zero3", marks=[pytest.mark.slow, *KINDS[1].marks])
HERE = Path(__file__).parent
JOB = ["engine=transformers", "num_iterations=2", "max_steps=6"]  # (3 rollouts of 2 optimizer steps each)
LORA = ["use_peft=true", "lora_dropout=0"]  # (dropout draws from each process's own random stream)

RECIPES = HERE.parent / "recipes" / "accelerate"


def cpu_config(kind: str, base: Path) -> Path:
    """The shipped recipes/accelerate/{fsdp2,zero3}.yaml for 2 CPU processes in float32 (no mixed precision), in
    `base`. ZeRO-3's settings go through a DeepSpeed config file with stage3_param_persistence_threshold 0, the one
    way accelerate passes it: DeepSpeed keeps every parameter below it whole on every process (10^5 elements by
    default: all of this tiny model's, almost none of a real model's)."""
    config = yaml.safe_load((RECIPES / f"{kind}.yaml").read_text())
    config.update(num_processes=2, mixed_precision="no")
    if kind == "zero3":
        del config["mixed_precision"]  # (with a DeepSpeed config file accelerate takes none of these from its own)
        ds = config["deepspeed_config"]
        zero = {"stage": ds.pop("zero_stage"), "stage3_param_persistence_threshold": 0,
                "offload_param": {"device": ds.pop("offload_param_device")},
                "offload_optimizer": {"device": ds.pop("offload_optimizer_device")}}
        ds.pop("zero3_save_16bit_model")
        (base / "ds3.json").write_text(json.dumps({"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
                                                   "gradient_clipping": "auto", "gradient_accumulation_steps": 1}))
        ds["deepspeed_config_file"] = str(base / "ds3.json")
    path = base / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(base: Path, kind: str, *extra: str, script: Path = HERE / "accelerate_driver.py") -> list[str]:
    """`accelerate launch` arguments that run `script` under `kind` (fsdp2 or zero3), 2 processes; `extra` are
    the launcher's own options."""
    config = base / f"{kind}.yaml"
    if not config.exists():
        cpu_config(kind, base)
    return ["-m", "accelerate.commands.launch", "--config_file", str(config), *extra, str(script)]


def final_weights(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rewards(rows: list[dict]) -> list[float]:
    """reward/total of each rollout (logged with the first optimizer step it feeds)."""
    return [r["reward/total"] for r in rows if "reward/total" in r]


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """Runs by name, each made once: ("one" | "fsdp2" | "zero3", lora) -> its output directory."""
    base = tmp_path_factory.mktemp("sharded")
    env = job(base, tiny_model_dir)
    made: dict = {}

    def get(kind: str, lora: bool = False, sp: int = 1) -> Path:
        if (kind, lora, sp) not in made:
            out = base / f"{kind}{'-lora' if lora else ''}{f'-sp{sp}' if sp > 1 else ''}"
            (out / "memory").mkdir(parents=True)
            args = [str(HERE / "accelerate_driver.py")] if kind == "one" else launch(
                base, kind, "--main_process_port", str(free_port()))
            overrides = [*JOB, *(LORA if lora else []), f"sequence_parallel_size={sp}"]
            if lora and kind != "one":  # sampling through the sharded model; the full runs sample from gathered weights
                overrides.append("ds3_gather_for_generation=false")
            said = run(args, out, {**env, "GRPO_TEST_MEMORY": str(out / "memory")}, overrides=overrides)
            (out / "memory" / "said.txt").write_text(said.stdout + said.stderr)  # (what the run printed)
            made[kind, lora, sp] = out
        return made[kind, lora, sp]

    get.base, get.env = base, env
    return get


@pytest.mark.parametrize("kind,lora", [("fsdp2", False), ("fsdp2", True),
                                       pytest.param("zero3", False, marks=KINDS[1].marks),
                                       pytest.param("zero3", True, marks=SLOW_ZERO3.marks)],
                         ids=["full-fsdp2", "lora-fsdp2", "full-zero3", "lora-zero3"])
def test_sharded_run_matches_one_process(runs, kind, lora):
    one, sharded = runs("one", lora), runs(kind, lora)
    # Same completions at every step (sampling seeds belong to rows), same gradients up to summation order.
    rows_one, rows = metrics(one), metrics(sharded)
    assert len(rewards(rows_one)) == 3 and rewards(rows) == rewards(rows_one)
    for a, b in zip(rows_one, rows):
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    # Float summation order (reduce-scatter vs one batch), amplified by Adam where a gradient is near 0: measured
    # 6.4e-5 (full; DDP's 2 processes on this job: 6.8e-5) and 6e-6 (LoRA, merged into final/).
    assert max_diff(final_weights(one), final_weights(sharded)) < 2e-4
    # final/ as one process writes it (with LoRA: the merged model, and the adapter in adapter/), loadable.
    for sub in ("final", "final/adapter") if lora else ("final",):
        assert sorted(p.name for p in (sharded / sub).iterdir()) == sorted(p.name for p in (one / sub).iterdir())
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(sharded / "final").config.architectures == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("kind", ["fsdp2", SLOW_ZERO3])
def test_sequence_parallel_over_sharded_weights_matches_one_process(runs, kind):
    """sequence_parallel_size=2 on the 2 sharded processes: one SP group, each process holding half of every packed
    micro-batch's tokens and half of the weights. The passes take the model's own forward through the wrapper (its
    gathers and gradient reduce-scatters as in any pass) with logits at this process's scored positions only, and
    reach the one-process run's rewards, gradient norms and weights (the bound of the sharded runs above)."""
    one, split = runs("one"), runs(kind, sp=2)
    assert "Ulysses over 2 processes" in (split / "memory" / "said.txt").read_text()
    rows_one, rows = metrics(one), metrics(split)
    assert len(rewards(rows_one)) == 3 and rewards(rows) == rewards(rows_one)
    for a, b in zip(rows_one, rows):
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    assert max_diff(final_weights(one), final_weights(split)) < 2e-4


@pytest.mark.parametrize("kind", KINDS)
def test_each_process_holds_about_half_the_weights_and_optimizer_state(runs, kind):
    """Bytes of the tensors each process holds (its shards, its optimizer state), the most at the end of any step,
    against the one-process run's: measured 0.500 for both (the one-process run: 105 KiB of weights, 211 KiB of
    AdamW state)."""
    one = json.loads((runs("one") / "memory" / "rank0.json").read_text())
    for rank in (0, 1):
        held = json.loads((runs(kind) / "memory" / f"rank{rank}.json").read_text())
        assert held["weights"] <= 0.6 * one["weights"], held
        assert (held["weights"] + held["optimizer"]) / (one["weights"] + one["optimizer"]) <= 0.6, held


@pytest.mark.parametrize("kind,point", [("fsdp2", "micro_step:4"),
                                        pytest.param("zero3", "save:2", marks=SLOW_ZERO3.marks)])
def test_kill_and_resume_reaches_the_uninterrupted_weights(runs, tmp_path, kind, point):
    """SIGKILL of the main process after the first micro-batch of step 4 (FSDP2: the second optimizer step of the
    second rollout, so the last checkpoint, of step 3, holds each process's rows of a rollout still feeding a step),
    or while the checkpoint of step 2 is written (ZeRO-3, after every process wrote its part, before the rename);
    the launcher then stops the other. Resume continues from the last complete checkpoint to the uninterrupted
    run's weights, bit for bit."""
    out = runs.base / f"killed-{kind}"
    killed = run(launch(runs.base, kind, "--main_process_port", str(free_port())), out,
                 {**runs.env, "GRPO_TEST_KILL": point}, succeed=False, overrides=[*JOB, "save_steps=1"])
    assert killed.returncode != 0 and "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert not (out / "final").exists()
    if point.startswith("save"):
        assert (out / "checkpoint-2.tmp").is_dir() and not (out / "checkpoint-2").exists()
    run(launch(runs.base, kind, "--main_process_port", str(free_port())), out, runs.env,
        overrides=[*JOB, "save_steps=1", "resume=true"])
    assert max_diff(final_weights(runs(kind)), final_weights(out)) == 0.0
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    from transformers import AutoModelForCausalLM

    from grpo.training.checkpoint.files import latest_checkpoint

    AutoModelForCausalLM.from_pretrained(latest_checkpoint(out))  # a checkpoint's top level is a model directory


def test_a_damaged_sharded_checkpoint_falls_back_exactly(runs):
    """FSDP2 (issue 34): a run killed in step 4 leaves checkpoint-2 and checkpoint-3; one process's shard file of
    checkpoint-3 is cut short. Resume names it in one line, falls back to checkpoint-2 and reaches the uninterrupted
    run's weights, bit for bit."""
    out = runs.base / "damaged-fsdp2"
    killed = run(launch(runs.base, "fsdp2", "--main_process_port", str(free_port())), out,
                 {**runs.env, "GRPO_TEST_KILL": "micro_step:4"}, succeed=False, overrides=[*JOB, "save_steps=1"])
    assert killed.returncode != 0, killed.stderr[-3000:]
    shard = sorted((out / "checkpoint-3" / "sharded").glob("*.distcp"))[-1]  # (the second process's)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    resumed = run(launch(runs.base, "fsdp2", "--main_process_port", str(free_port())), out, runs.env,
                  overrides=[*JOB, "save_steps=1", "resume=true"])
    said = [line for line in resumed.stdout.splitlines() if " is damaged: " in line]
    assert said == [f"resume: {out}/checkpoint-3 is damaged: sharded/{shard.name} has {size - 100} bytes, its "
                    f"manifest says {size}. Falling back to {out}/checkpoint-2, the newest intact checkpoint."], \
        resumed.stdout[-3000:]
    assert max_diff(final_weights(runs("fsdp2")), final_weights(out)) == 0.0


def test_two_machines_train_as_one_launch(runs):
    """Two launches of one process each, machine ranks 0 and 1 of 2, meeting at 127.0.0.1 over gloo (as two
    machines would over the network), reach the weights of one launch of 2 processes exactly."""
    out, port = runs.base / "two-machines", str(free_port())
    env = {**runs.env}
    procs = []
    for rank in (0, 1):
        machine = ["--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
                   "--main_process_ip", "127.0.0.1", "--main_process_port", port]
        args = [sys.executable, *launch(runs.base, "fsdp2", *machine), "train", str(runs.base / "recipe.yaml"),
                f"output_dir={out}", *JOB]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    assert max_diff(final_weights(runs("fsdp2")), final_weights(out)) == 0.0
    assert rewards(metrics(out)) and rewards(metrics(out)) == rewards(metrics(runs("fsdp2")))


@pytest.mark.parametrize("kind", ["fsdp2", SLOW_ZERO3])
def test_sampling_is_collective_safe_and_weights_go_one_tensor_at_a_time(runs, tmp_path, kind, tiny_model_dir):
    """tests/sharded_checks.py with a LoRA model: the main process's rows end at their first token and the other's
    run to the limit. Through the sharded model (each forward collective) and from gathered weights, the run
    finishes (a process that stopped stepping early would leave the other waiting: the timeout) and the long rows
    are the whole model's. An engine that keeps its own copy gets the whole model's merged weights, with no
    parameter left whole between tensors."""
    args = launch(runs.base, kind, "--main_process_port", str(free_port()), script=HERE / "sharded_checks.py")
    result = subprocess.run([sys.executable, *args, tiny_model_dir, str(tmp_path), "lora"], env=runs.env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["sharding"] == second["sharding"] == kind
    for key in ("synced_sample", "gathered_sample"):
        assert all(len(row) == 1 for row in first[key])  # stopped at once
        assert second[key] == second["whole_sample"]  # stepped to the end, as the whole model samples
    for out in (first, second):
        assert out["whole_after_gathering"] == 0  # released after the rollout
        assert out["loss"] == pytest.approx(out["whole_loss"], rel=1e-6)
        assert out["names"] == out["expected_names"] and out["max_weight_diff"] <= 1e-6
        assert out["most_whole_per_tensor"] == 0


def accelerator(distributed_type: str, **state):
    return SimpleNamespace(distributed_type=distributed_type, state=SimpleNamespace(**state))


def test_what_the_sharded_paths_do_not_run_is_refused_before_the_model_loads(monkeypatch):
    from grpo.config import ConfigError, GRPOConfig
    from grpo.training.setup.sharded import check_sharding

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # launched with fsdp2.yaml, where accelerate has no GPU
    with pytest.raises(ConfigError, match="ddp_cpu.yaml"):
        check_sharding(accelerator("MULTI_CPU"), GRPOConfig())
    monkeypatch.delenv("ACCELERATE_USE_FSDP")

    fsdp1 = accelerator("FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=1))
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        check_sharding(fsdp1, GRPOConfig())
    fsdp2 = accelerator("FSDP", fsdp_plugin=SimpleNamespace(fsdp_version=2))
    check_sharding(fsdp2, GRPOConfig(ds3_gather_for_generation=False))
    zero2 = accelerator("DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=2))
    for whole in (accelerator("MULTI_CPU"), zero2):  # nothing to gather: the key would be read by nothing
        with pytest.raises(ConfigError, match="ds3_gather_for_generation: false applies to sharded weights"):
            check_sharding(whole, GRPOConfig(ds3_gather_for_generation=False))
    zero3 = accelerator("DEEPSPEED", deepspeed_plugin=SimpleNamespace(zero_stage=3))
    with pytest.raises(ConfigError, match="vLLM always receives whole weights"):
        check_sharding(zero3, GRPOConfig(ds3_gather_for_generation=False, use_vllm=True))
    for sharded in (fsdp2, zero3):
        with pytest.raises(ConfigError, match="reference_weights: disk"):
            check_sharding(sharded, GRPOConfig(reference_weights="disk"))
    for sharded in (fsdp2, zero3):  # the reference's state dict is this process's shards (ZeRO-3: "module." names)
        with pytest.raises(ConfigError, match="sync_ref_model: not built with sharded weights"):
            check_sharding(sharded, GRPOConfig(sync_ref_model=True, beta=0.04))
    check_sharding(zero2, GRPOConfig(sync_ref_model=True, beta=0.04))  # whole weights in each process: it runs


def test_fsdp2_under_bf16_reduces_gradients_in_float32():
    """accelerate turns `mixed_precision: bf16` into a policy that reduce-scatters gradients in bf16; the trainer
    gives fully_shard one that reduces them in float32 (verl's default) and computes in bf16 as before."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    from grpo.training.setup.sharded import float32_reduce, reduce_in_float32

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does for an FSDP2 launch with bf16
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16  # accelerate's own choice
    reduce_in_float32(accelerator("FSDP", fsdp_plugin=plugin))  # (what the trainer calls before prepare)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32,
                                                                               torch.bfloat16)
    assert float32_reduce(None) is None  # no mixed precision: float32 throughout already
    assert float32_reduce(type(policy)(param_dtype=torch.bfloat16)).reduce_dtype == torch.float32  # None: bf16's
    assert float32_reduce(type(policy)()).reduce_dtype is None  # float32 parameters: nothing to change
