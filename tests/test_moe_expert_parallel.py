"""Expert parallelism (grpo.engines.expert_parallel): the shipped tiny-moe's experts split over gloo processes reach
the one-process run's rewards and weights; an EP checkpoint resumes exactly and is an ordinary model directory;
what EP cannot combine with is refused by name.

The runs are test_distributed.py's recipe (3 steps, 4 prompts x 8 completions of up to 8 tokens) on tiny-moe (4
experts per layer, top-2) with test_distributed.LINEAR_ADAM: a one-process run and an EP run differ only in the
order of float32 sums (an expert's gradient summed by the exchanges' backward and an all-reduce, vs in one pass), and
with Adam's epsilon at 1 a rounding difference in a gradient moves a weight by lr (1) times that difference, so the
weights agree to about the gradients' rounding (measured 9e-7) where a wrong expert gradient (a shard averaged with
another process's experts by DDP, or a gradient counted twice) moves them by the size of a gradient (~1e-2).
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from test_distributed import F32_EPS, LINEAR_ADAM, RECIPE, free_port, job, run

from grpo.config import ConfigError, GRPOConfig


# Routing replay on, each rollout trained twice: the second pass's routers (after an optimizer step) pick other experts
# for some tokens and R3 forces the rollout's (`moe/routing_mismatch` > 0 in the one-process run), so an EP run that
# dropped the replay would train those tokens under other experts and end ~1e-2 from the one-process weights.
REPLAY = ["router_replay=R3", "num_iterations=2"]


def launch(processes: int) -> list[str]:
    if processes == 1:
        return ["-m", "grpo.cli"]
    return ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(free_port()),
            "-m", "grpo.cli"]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out, name="final"):
    return load_file(str(out / name / "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)  # (every expert of every layer: the EP run's final/ holds them all)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    base = tmp_path_factory.mktemp("ep")
    env = job(base, "tiny-moe")
    run(launch(1), base / "one", env, overrides=[*LINEAR_ADAM, *REPLAY])
    return base, env


@pytest.mark.parametrize("processes, more", [(2, []), (4, ["gradient_checkpointing=true"])],
                         ids=["ep2", "dp2-ep2-checkpointing"])
def test_expert_parallel_matches_one_process(one_process, processes, more):
    """expert_parallel_size=2 on 2 processes (each holding 2 of the 4 experts of every layer) and on 4 (DP=2 x EP=2:
    two groups, each process with its own rows) reaches the one-process run's weights within 1e-4 after 3 steps
    (measured 9e-7 and 9.4e-7), with the same rewards at every step, and the gradient norm (over every process's
    shards) to the rounding of a reordered float32 sum of n terms, 8 * F32_EPS * sqrt(n) relative
    (test_distributed.assert_reordered_run's bound: a gradient element sums over the step's tokens, 32 rows of at
    most 4 prompt and 8 completion tokens; measured 1.2e-5 against a bound of 1.9e-5). Rows end
    at different times on different processes (completions of 5.7 tokens on average, at most 8): each generation
    step's exchanges run until every process's rows have stopped. The 4-process run also recomputes each layer's
    forward, its exchanges included, in backward (gradient checkpointing)."""
    base, env = one_process
    out = base / f"ep{processes}"
    result = run(launch(processes), out, env, overrides=[*LINEAR_ADAM, *REPLAY, "expert_parallel_size=2", *more])
    assert "num_generations: 8\nprompts_per_step: 4" in RECIPE and "max_completion_length: 8" in RECIPE
    rows = metrics(base / "one"), metrics(out)
    assert max(r.get("moe/routing_mismatch", 0) for r in rows[0]) > 0  # (the replay overrode the live routers)
    assert [r.get("reward/total") for r in rows[1]] == [r.get("reward/total") for r in rows[0]]
    rel = 8 * F32_EPS * (32 * (4 + 8)) ** 0.5
    for a, b in zip(*rows):
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=rel)
    assert max_diff(weights(base / "one"), weights(out)) < 1e-4
    assert f"{processes} processes" in result.stdout


def test_an_expert_parallel_checkpoint_resumes_exactly_and_loads_whole(tmp_path):
    """EP=2 on 2 processes with a checkpoint every step, resumed from checkpoint-1 in a fresh directory, ends on the
    uninterrupted run's weights (Adam at its defaults: each process's optimizer state of its own experts comes back
    from the checkpoint's per-process part; rank 0's state alone would move rank 1's experts otherwise). The
    checkpoint is an ordinary model directory: from_pretrained loads every expert of it."""
    from transformers import AutoModelForCausalLM

    env = job(tmp_path, "tiny-moe")
    over = ["expert_parallel_size=2", "save_steps=1", "save_total_limit=null", "max_steps=2"]
    run(launch(2), tmp_path / "straight", env, overrides=over)
    shutil.copytree(tmp_path / "straight" / "checkpoint-1", tmp_path / "checkpoint-1")
    run(launch(2), tmp_path / "resumed", env,
        overrides=[*over, f"resume_from_checkpoint={tmp_path / 'checkpoint-1'}"])
    assert max_diff(weights(tmp_path / "straight"), weights(tmp_path / "resumed")) < 1e-6
    assert [r["step"] for r in metrics(tmp_path / "resumed")] == [2]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "checkpoint-1")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == experts.num_experts == 4


def config(**values) -> GRPOConfig:
    return GRPOConfig(**{"output_dir": "/tmp/unused", **values})


@pytest.mark.parametrize("values, distributed, words", [
    ({"expert_parallel_size": 2}, "MULTI_CPU", "3 processes do not split into groups of 2"),
    ({"expert_parallel_size": 3}, "FSDP", "FSDP shards the weights itself"),
    ({"expert_parallel_size": 3}, "DEEPSPEED", "DEEPSPEED shards the weights itself"),
    ({"expert_parallel_size": 3, "sequence_parallel_size": 3}, "MULTI_CPU", "sequence_parallel_size > 1"),
    ({"expert_parallel_size": 3, "use_vllm": True}, "MULTI_CPU", "use_vllm"),
    ({"expert_parallel_size": 3, "max_staleness": 1}, "MULTI_CPU", "max_staleness: 0"),
    ({"expert_parallel_size": 3, "use_peft": True}, "MULTI_CPU", "use_peft"),
    ({"expert_parallel_size": 3, "multi_turn": True}, "MULTI_CPU", "multi-turn rollouts"),
])
def test_what_expert_parallelism_cannot_combine_with_is_refused_by_name(values, distributed, words):
    from grpo.training.setup.experts import check_expert_parallel

    values = dict(values)
    multi_turn = values.pop("multi_turn", False)
    with pytest.raises(ConfigError, match="expert_parallel_size") as err:
        check_expert_parallel(config(**values), 3, distributed, multi_turn)
    assert words in str(err.value)


def test_the_key_its_aliases_and_what_the_model_must_have(monkeypatch):
    """Megatron's expert_model_parallel_size and transformers' ep_size are the key; a dense model, or a number of
    experts the size does not divide, is refused by name (before any process group is made)."""
    from grpo.engines import expert_parallel
    from grpo.training.setup.experts import make_expert_parallel
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    assert config(expert_model_parallel_size=2).expert_parallel_size == 2
    assert config(ep_size=4).expert_parallel_size == 4
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        config(expert_parallel_size=0)
    dense = SimpleNamespace(modules=lambda: iter(()))
    with pytest.raises(ConfigError, match="no stacked experts to split"):
        make_expert_parallel(config(expert_parallel_size=2), None, dense, None)
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                             moe_intermediate_size=8, num_experts_per_tok=2))
    group = expert_parallel.ExpertGroup(None, None, 0, 3, 3)
    with pytest.raises(ConfigError, match="3 does not divide the model's 4 experts"):
        expert_parallel.split_experts(moe, group)


def _families_worker(rank: int, port: int, families: tuple, out: str) -> None:
    """One of 2 gloo processes: for each family, the model split over both, run on this rank's own rows."""
    import os

    import torch
    import torch.distributed as dist

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))  # (spawned: this directory's conftest first, not trl_suite's)
    sys.modules.pop("conftest", None)
    from grpo.engines import expert_parallel
    from test_moe import tiny_moe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ep = expert_parallel.expert_group(rank, 2, 2)
    found = {}
    for family in families:
        whole, split = tiny_moe(family), tiny_moe(family)
        shards = expert_parallel.split_experts(split, ep)
        ids = torch.randint(2, 40, (2, 2, 7), generator=torch.Generator().manual_seed(family.__len__()))
        whole_grads = []
        for r in range(2):  # the whole model's gradient of each rank's rows
            whole.zero_grad()
            whole(input_ids=ids[r]).logits.pow(2).mean().backward()
            whole_grads.append({n: p.grad.clone() for n, p in whole.named_parameters()})
        logits = split(input_ids=ids[rank]).logits
        logits.pow(2).mean().backward()
        expected = whole(input_ids=ids[rank]).logits
        errors = [(logits - expected).abs().max().item()]
        for name, p in split.named_parameters():
            if any(p is s for s in shards):  # the shard's gradient: every rank's tokens through its experts
                local = p.shape[0]
                want = sum(g[name] for g in whole_grads)[rank * local:(rank + 1) * local]
            else:  # a replicated weight's: this rank's rows only (DDP would average them)
                want = whole_grads[rank][name]
            errors.append((p.grad - want).abs().max().item())
        found[family] = max(errors)
    torch.save(found, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_each_family_splits_and_its_gradients_are_the_whole_models(tmp_path):
    """qwen3_moe, qwen2_moe (with its shared expert), olmoe and mixtral, split over 2 gloo processes, each with rows
    of its own: the logits are the whole model's on those rows, each expert shard's gradient is the sum of the whole
    model's over both processes' rows, and every other weight's (the routers' included: the routing weights'
    gradient comes back through the exchange) is the whole model's on this process's rows. float32, sums of a few
    dozen terms in another order: 1e-6 bounds their rounding (measured at most 3e-11)."""
    import torch.multiprocessing as mp

    families = expert_parallel_families()
    mp.spawn(_families_worker, args=(free_port(), families, str(tmp_path)), nprocs=2)
    import torch

    for rank in (0, 1):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(found) == set(families)
        assert all(error < 1e-6 for error in found.values()), found


def expert_parallel_families() -> tuple:
    from grpo.engines.expert_parallel import SPLITTABLE

    names = {"Qwen3MoeExperts": "qwen3_moe", "Qwen2MoeExperts": "qwen2_moe", "OlmoeExperts": "olmoe",
             "MixtralExperts": "mixtral"}
    return tuple(names[n] for n in SPLITTABLE)
