"""Checks of grpo.engines.sharding inside processes that accelerate sharded (FSDP2 or ZeRO-3) on the CPU
(used by test_sharded.py):

    accelerate launch --config_file CONFIG.yaml sharded_checks.py MODEL_DIR OUT_DIR [lora]

Each process writes OUT_DIR/rank<R>.json with what it saw; the test compares it with the same model held whole.
- sampling through the sharded model (ds3_gather_for_generation off) and from gathered weights (on), with the main
  process's rows ending at their first token and the other's running to the length limit: each forward of the
  sharded model is collective, so a process that stopped early and stepped no more would leave the other waiting
  forever (the test's timeout). The running process's completion must be the one the whole model samples.
- after the gathered block the weights are sharded again, and a forward with gradients gives the whole model's loss.
- the weights handed to an engine that keeps its own copy (vLLM's `update_weights`): `hf_weights` one tensor at a
  time, recorded by a fake engine together with how much of the model was whole at each tensor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import accelerate_driver  # noqa: F401 - accelerate sees the processes as on a GPU machine
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.engines.base import SamplingParams
from grpo.engines.sampling import TransformersSampler
from grpo.engines.select import EngineChoice, make_sampler
from grpo.engines.sharding import WholeWeightsSampler, hf_weights, sharding

PROMPTS = [[5, 6, 7], [8, 9]]
PARAMS = SamplingParams(max_new_tokens=6)
SEEDS = [11, 12]


def load(model_dir: str, lora: bool):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
        for name, p in model.named_parameters():  # (lora_B starts at 0: give the adapters a delta to merge)
            if "lora_B" in name:
                p.data.normal_(0, 0.5)
    return model


def whole_count(model) -> int:
    """How many of the model's parameters this process holds whole right now (outside a forward: none)."""
    from torch.distributed.fsdp import FSDPModule

    if sharding(model) == "zero3":
        return sum(p.data.numel() > 0 for p in model.parameters())
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
    return sum(len(g.fsdp_params) for g in groups if g.is_unsharded)


class RecordingEngine:
    """A fake vLLM engine: `update_weights` takes the policy's weights as vLLM's engine does (`hf_weights`) and
    records each tensor and how many of the policy's parameters were whole when it arrived."""

    def __init__(self):
        self.weights, self.whole_at_each = {}, []

    def update_weights(self, model) -> None:
        for name, tensor in hf_weights(model):
            self.whole_at_each.append(whole_count(model))
            self.weights[name] = tensor.clone()


def sample(sampler, rank: int, eos_token: int):
    # The main process's rows end at their first token (every token is an EOS there); the other's never end.
    inner = sampler.sampler if isinstance(sampler, WholeWeightsSampler) else sampler
    inner.eos_ids = list(range(300)) if rank == 0 else [eos_token + 1000]
    return sampler.generate(PROMPTS, PARAMS, SEEDS).ids


def main(model_dir: str, out_dir: str, lora: bool) -> None:
    torch.manual_seed(0)
    whole = load(model_dir, lora)  # (before the Accelerator: under ZeRO-3's zero3_init_flag a load is partitioned)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    accel = Accelerator()
    model = load(model_dir, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if accel.distributed_type == "DEEPSPEED":
        accel.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    model, optimizer = accel.prepare(model, optimizer)
    policy, rank = accel.unwrap_model(model), accel.process_index
    choice = EngineChoice("transformers", "test")
    reference = TransformersSampler(whole, tokenizer.pad_token_id, [])
    out = {"sharding": sharding(model), "whole_sample": reference.generate(PROMPTS, PARAMS, SEEDS).ids}
    out["synced_sample"] = sample(make_sampler(choice, policy, tokenizer, model, False), rank, tokenizer.eos_token_id)
    gathered = make_sampler(choice, policy, tokenizer, model, True)
    out["gathered_sample"] = sample(gathered, rank, tokenizer.eos_token_id)
    out["whole_after_gathering"] = whole_count(policy)

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out["loss"], out["whole_loss"] = (float(m(input_ids=ids, labels=ids).loss) for m in (model, whole))

    engine = RecordingEngine()
    engine.update_weights(policy)
    expected = dict(hf_weights(whole))
    out["names"], out["expected_names"] = sorted(engine.weights), sorted(expected)
    out["max_weight_diff"] = max((engine.weights[k] - expected[k]).abs().max().item() for k in expected)
    out["most_whole_per_tensor"] = max(engine.whole_at_each)
    out["parameters"] = sum(1 for _ in policy.parameters())
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "lora")
