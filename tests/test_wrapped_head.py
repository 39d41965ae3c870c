"""A DDP-wrapped model's training pass through the tiled head (D12): the forward runs through the wrapper (so DDP's
gradient reduction is prepared as usual), the model's own head sees one position per row, and the gradients are
the unwrapped model's. One process with gloo, in a subprocess (its process group stays out of the test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import copy, json, sys
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from grpo.engines.packing import choose_packing, pack
from grpo.engines.policy import completion_logprobs, tiled_head
from grpo.training.rollout.batch import pack as pad_rows

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
torch.manual_seed(0)
plain = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa")
ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
g = torch.Generator().manual_seed(0)
V = plain.config.vocab_size
prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in (3, 3, 6, 6)]
completions = [torch.randint(2, V, (n,), generator=g).tolist() for n in (5, 2, 7, 4)]
ids, mask, _ = pad_rows(prompts, completions, 1, [True] * 4)
width = 7
head_inputs = []
ddp.module.lm_head.register_forward_hook(lambda m, args, out: head_inputs.append(list(args[0].shape)))
out = {"tiled": [tiled_head(ddp)[1] is ddp.module, tiled_head(plain)[1] is None]}
for name, packed in (("padded", None), ("packed", pack(ids, mask, width, choose_packing(plain)[0]))):
    grads = []
    for model in (plain, ddp):
        model.zero_grad(set_to_none=True)
        logp = completion_logprobs(model, ids, mask, width, 0.9, packed=packed)
        (logp * mask[:, -width:]).sum().backward()
        inner = model.module if model is ddp else model
        grads.append([p.grad.clone() for p in inner.parameters()])
    out[name] = {"max_rel": max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
                                for a, b in zip(*grads)), "head_inputs": head_inputs[:]}
    head_inputs.clear()
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


def test_ddp_training_pass_uses_the_tiled_head_and_matches_the_unwrapped_gradients(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    from test_distributed import free_port

    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dir, str(free_port())], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert out["tiled"] == [True, True]
    # The wrapped forward's own head ran on 4 rows x 1 position (padded: 4 rows; packed: its R rows), never on the
    # (rows, positions, V) logits: the log-probs came from the tiled head on the caught hidden states.
    assert out["padded"]["head_inputs"] == [[4, 1, 32]]
    assert len(out["packed"]["head_inputs"]) == 1 and out["packed"]["head_inputs"][0][1:] == [1, 32]
    assert out["padded"]["max_rel"] < 1e-5 and out["packed"]["max_rel"] < 1e-5
