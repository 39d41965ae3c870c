"""An MoE model (the shipped tiny-moe) under sharded weights, FSDP2 and DeepSpeed ZeRO-3 on 2 gloo processes
(tests/test_sharded.py's launch), reaches the one-process run's rewards and weights.

test_distributed.py's recipe (3 steps, 4 prompts x 8 completions of up to 8 tokens) with test_distributed.LINEAR_ADAM
(Adam's epsilon 1, lr 1: a rounding difference in a gradient moves a weight by that difference, not by up to lr), on
the transformers engine in both runs, with the model's load-balancing loss in the loss (Qwen3-MoE's default
router_aux_loss_coef 0.001). The runs differ only in the order of float32 sums (a reduce-scatter vs one process's
pass): measured 3.6e-7 (FSDP2) and 2.8e-7 (ZeRO-3) apart.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from test_distributed import F32_EPS, LINEAR_ADAM, RECIPE, job, run
from test_sharded import KINDS, free_port, launch

# Routing replay on and each rollout trained twice (test_moe_expert_parallel.REPLAY): the one-process run's replay
# overrides the live routers for some tokens, so a sharded pass that dropped it would end far from its weights.
OVERRIDES = ["engine=transformers", *LINEAR_ADAM, "router_replay=R3", "num_iterations=2"]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from test_sharded import HERE

    base = tmp_path_factory.mktemp("moe-sharded")
    env = job(base, "tiny-moe")
    run([str(HERE / "accelerate_driver.py")], base / "one", env, overrides=OVERRIDES)
    return base, env


@pytest.mark.parametrize("kind", KINDS)
def test_moe_under_sharded_weights_matches_one_process(one_process, kind):
    """Each process holds half of every weight, the stacked experts included; the routers' logits and the aux loss
    come from the gathered layers. Same rewards at every step, the gradient norm to the rounding of a reordered
    float32 sum of 32 x (4 + 8) terms (test_distributed.assert_reordered_run's bound, 8 * F32_EPS * sqrt(n)), the
    weights within 1e-4, and final/ holds every expert. Under FSDP2 the aux loss failed before it looked the loss
    function up through the model's class hierarchy (FSDP2's subclass lives in a torch module)."""
    base, env = one_process
    out = base / kind
    run(launch(base, kind, "--main_process_port", str(free_port())), out, env, overrides=OVERRIDES)
    one, sharded = metrics(base / "one"), metrics(out)
    assert max(r.get("moe/routing_mismatch", 0) for r in one) > 0  # (the replay overrode the live routers)
    assert "num_generations: 8\nprompts_per_step: 4" in RECIPE and "max_completion_length: 8" in RECIPE
    assert [r.get("reward/total") for r in sharded] == [r.get("reward/total") for r in one]
    rel = 8 * F32_EPS * (32 * (4 + 8)) ** 0.5
    for a, b in zip(one, sharded):
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=rel)
        assert b["moe/aux_loss"] == pytest.approx(a["moe/aux_loss"], rel=rel)
    want, got = (load_file(str(d / "final" / "model.safetensors")) for d in (base / "one", out))
    assert sorted(want) == sorted(got)
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-4
