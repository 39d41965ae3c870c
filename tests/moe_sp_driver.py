"""One process of test_moe_pipeline's sequence-parallel replay check, launched by torch.distributed.run with gloo:

    python -m torch.distributed.run --nproc_per_node SP moe_sp_driver.py OUT_DIR

Every process builds the same tiny Qwen3-MoE (test_moe.tiny_moe: 2 layers, 4 experts, top-2, 2 attention heads, 1
key/value head), samples the same rollout of 4 rows with its routes recorded, packs it in one row (as sequence
parallelism does), and perturbs the routers (so that the update would route some tokens otherwise). Then:

    one process   the packed pass over the whole row under R3 (grpo.engines.moe.RoutingPass), a loss plus COEF x
                  the router's load-balancing loss (its tokens weighted as TRL's batch holds them) backpropagated;
    SP processes  the Ulysses pass (grpo.engines.ulysses), each over its slice, under `Routing.update_pass` (the
                  routes sliced as the tokens are, the router logits gathered for the aux loss), the same loss, the
                  gradients summed over the group;

and writes OUT_DIR/rank<R>.json: whether every token of its slice ran, in every layer, on its rollout experts (and
how many tokens the slice checked), the log-probs' and the gradients' largest relative differences to the one-process
pass, the aux losses', the routers' gradient, and `moe/routing_mismatch` of both (the SP one summed over the group).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.engines import moe
from grpo.engines.base import SamplingParams
from grpo.engines.packing import Packing, pack
from grpo.engines.policy import MicroBatch, completion_logprobs
from grpo.engines.sampling import TransformersSampler
from grpo.engines.ulysses import SequenceGroup, installed, local_rows, sequence_parallel_logprobs
from grpo.training.rollout.batch import pack as pad_rows
from test_moe import tiny_moe

ONE_ROW = Packing(False, None, None, "sequence parallel: whole sequences in one row")
COEF = 0.5  # (large, so that a wrong aux gradient shows above float rounding)
PROMPTS = [[5, 6, 7], [5, 6, 7], [9, 10, 11, 12], [9, 10, 11, 12, 13]]  # (59 tokens: the last slice padded)


def rollout(model) -> tuple[MicroBatch, torch.Tensor]:
    """The rollout of PROMPTS (up to 12 new tokens each) as one packed micro-batch with its routes, and its loss
    mask (n, width)."""
    sampler = TransformersSampler(model, pad_id=1, eos_ids=[0])
    sampler.routes = moe.RouteRecorder(model)
    out = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=12), seeds=[1, 2, 3, 4])
    ids, mask, loss_mask = pad_rows(PROMPTS, out.ids, 1, [True] * len(PROMPTS))
    width, prompt = loss_mask.shape[1], ids.shape[1] - loss_mask.shape[1]
    routes = moe.batch_routes(out.routes, [len(p) for p in PROMPTS], prompt, ids.shape[1])
    packed = pack(ids, mask, width, ONE_ROW)
    return MicroBatch(ids, mask, width, packed=packed, routes=moe.packed_routes(routes, packed.source)), loss_mask


def loss_of(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    adv = torch.linspace(-1.0, 1.0, logp.shape[0])
    return -(adv * (logp * mask).sum(1) / mask.sum(1)).mean()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-30))


def experts_hooks(model, seen: dict) -> list:
    def keep(layer):  # (returns None: the output stays the experts')
        def hook(module, args, out):
            seen.setdefault(layer, args[1].clone())
        return hook

    return [layer.mlp.experts.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    sp = SequenceGroup(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    model = tiny_moe("qwen3_moe")
    model.config._attn_implementation = "sdpa"
    micro, loss_mask = rollout(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in moe.routers(model):
            router.weight.add_(torch.randn_like(router.weight))
    one = copy.deepcopy(model)

    with moe.RoutingPass(one, micro.routes, True, True) as hooks:
        logp = completion_logprobs(one, micro.input_ids, micro.attention_mask, micro.width, 1.0, packed=micro.packed)
        whole = hooks.stats(lambda tokens: moe.token_weights(micro.packed))
        (loss_of(logp, loss_mask) + COEF * whole.aux).backward()

    routing, seen = moe.Routing(True, COEF, lambda t: t, sp), {}

    class Backend:
        extra_loss = None

    backend, handles = Backend(), experts_hooks(model, seen)
    with installed(model), routing.update_pass(backend, model, micro, 1.0):
        sp_logp = sequence_parallel_logprobs(model, micro.packed, sp, 1.0)
        extra = backend.extra_loss()  # (COEF x the aux loss x share 1; the counts are taken)
        (loss_of(sp_logp, loss_mask) + extra).backward()
    for h in handles:
        h.remove()
    mine = local_rows(micro.routes, sp, moe.NOT_ROUTED)  # (this rank's slice of the rollout's routes)
    known = (mine != moe.NOT_ROUTED).all(-1).all(-1)
    same = all(torch.equal(seen[layer][known].sort(-1).values, mine[known, layer].long().sort(-1).values)
               for layer in range(len(model.model.layers)))
    grads = {}
    for (name, p), q in zip(model.named_parameters(), one.parameters()):
        dist.all_reduce(p.grad, group=sp.group)
        grads[name] = rel(p.grad, q.grad)
    result = {"same_experts": same, "checked": int(known.sum()), "slice": int(mine.shape[0]),
              "tokens": micro.packed.tokens, "logp": rel(sp_logp, logp), "grads": grads,
              "aux": rel(extra / COEF, whole.aux), "aux_one": float(whole.aux.detach()),
              "router_grad": min(float(r.weight.grad.abs().sum()) for r in moe.routers(model)),
              "mismatch_sp": routing.step_metrics()["moe/routing_mismatch"],
              "mismatch_one": int(whole.mismatched) / int(whole.routed)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{sp.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (ulysses_driver.py says why: gloo's workers can outlive main() and abort the finalizing interpreter)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
