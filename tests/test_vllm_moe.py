"""An MoE model (the shipped tiny-moe, a qwen3_moe) trained with vLLM rollouts on vLLM's CPU build, colocated and
from a `grpo vllm-serve` server: the engine follows the policy's experts after every push, the rollout's log-probs
are the update's, vLLM hands back each token's experts (grpo.engines.vllm_routes: on the CPU build through grpo's
hook on vLLM's routers), routing replay (R3) trains every pass under them, and with R3 off `moe/routing_mismatch`
counts the tokens the update routes otherwise.

The tests marked needs_vllm are skipped where vLLM is not importable: `bash scripts/vllm_env.sh`, then
`.venv-vllm/bin/python -m pytest -q tests/test_vllm_moe.py`.
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.engines import moe, vllm_routes
from grpo.engines.base import Completions, SamplingParams
from grpo.engines.sampling import TransformersSampler
from grpo.engines.vllm import VLLMEngine
from grpo.engines.vllm_protocol import GenerateReply, GenerateRequest
from grpo.tasks import get_task
from test_vllm import needs_vllm

# Two optimizer steps per rollout at a large rate: the second step's routers have moved since the rollout and route
# some tokens otherwise, so replay has something to override and the mismatch something to count.
JOB = dict(model_name_or_path="tiny-moe", task="arithmetic", max_steps=2, num_generations=4, prompts_per_step=2,
           max_completion_length=40, learning_rate=2e-3, num_iterations=2, save_steps=0, report_to=[],
           log_completions_steps=0, seed=0)


def metric_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "moe/routing_mismatch" in row]


@contextlib.contextmanager
def hand_counted_passes(trainer):
    """Every update pass counted by hand: the tokens the rollout's record (`micro.routes`, vLLM's) routed, and those
    whose experts the update's routers chose differ from it in some layer (from the routers' own outputs), summed
    per optimizer step. Yields {step: [routed, mismatched]}."""
    from test_moe_pipeline import first_outputs

    routing, policy, counts = trainer.updates.routing, trainer.policy, {}
    real = routing.update_pass

    @contextlib.contextmanager
    def watch(inner, micro):
        with first_outputs(moe.routers(policy), lambda args, out: out[2]) as live:  # (the routers' own choice)
            with inner:
                yield inner
        known = (micro.routes != moe.NOT_ROUTED).all(-1).all(-1)
        differs = torch.zeros_like(known)
        for layer, chosen in live.items():
            differs |= (chosen.sort(-1).values != micro.routes[:, layer].long().sort(-1).values).any(-1)
        step = counts.setdefault(trainer.control.state.global_step + 1, [0, 0])
        step[0] += int(known.sum())
        step[1] += int((differs & known).sum())

    routing.update_pass = lambda backend, model, micro, share: watch(real(backend, model, micro, share), micro)
    yield counts
    routing.update_pass = real


def train_watched(cfg: GRPOConfig, replay: bool):
    """Train `cfg`; with `replay`, every pass checked against the replayed record (test_moe_pipeline.watched_passes),
    else the mismatch counted by hand. Returns the trainer, the checked passes or the counts, and the size (sum of
    absolute values) of each gradient a router's weight received."""
    from test_moe_pipeline import watched_passes

    t = GRPOTrainer(args=cfg)
    assert t.generator.route_layers == 4 and len(moe.routers(t.policy)) == 4
    grads = [r.weight.register_hook(lambda g: seen_grads.append(float(g.abs().sum())))
             for r in moe.routers(t.policy)]
    seen_grads: list[float] = []
    with (watched_passes(t) if replay else hand_counted_passes(t)) as seen:
        t.train()
    for h in grads:
        h.remove()
    return t, seen, seen_grads


def assert_replayed(t, checked, grads, rows) -> None:
    """R3 with vLLM rollouts: every update and scoring pass ran, token for token and layer for layer, the experts of
    vLLM's record (watched_passes asserts it per pass); the routers learn through the replayed weights (the aux
    loss is off); the rollout's log-probs are the update's; replay overrode the moved routers on step 2."""
    kinds = [kind for kind, _ in checked]
    assert kinds.count("update") >= 2 and "score" in kinds and all(n > 0 for _, n in checked), checked
    assert len(grads) >= 8 and all(g > 0 for g in grads), grads  # (4 routers x 2 steps at least)
    assert len(rows) == 2
    for row in rows:
        # Same weights in float32 on both sides: pi_old / pi_vllm is 1 up to rounding (tests/test_vllm_training.py)
        assert abs(row["sampling/importance_ratio_mean"] - 1) < 1e-3, row
    # Step 1's passes run the rollout's weights: vLLM's record and transformers' routers agree on every token
    # (float32 on both sides; only a near-tie of two router logits could flip one). Step 2's routers have moved and
    # would route some tokens otherwise: replay forced those.
    assert rows[0]["moe/routing_mismatch"] == 0 and rows[1]["moe/routing_mismatch"] > 0, rows


def assert_hand_count(counts, rows) -> None:
    """R3 off: each step's moe/routing_mismatch is the hand count's share."""
    assert sorted(counts) == [1, 2] and counts[2][1] > 0, counts
    for step, row in zip((1, 2), rows):
        routed, mismatched = counts[step]
        # (metrics.jsonl keeps 6 significant digits: a relative rounding of at most 5e-6)
        assert row["moe/routing_mismatch"] == pytest.approx(mismatched / routed, rel=1e-5), (step, row, counts)


def assert_routes_are_the_policys(engine, policy, prompts) -> None:
    """vLLM's record of a rollout equals the policy's own routing of the same tokens under the same weights (a
    teacher-forced pass through transformers' routers), in every layer, for every token vLLM ran (all but each
    completion's last); float32 on both sides: measured equal on every token (a near-tie could flip one)."""
    out = engine.generate(prompts, SamplingParams(max_new_tokens=16), list(range(len(prompts))))
    chosen = {}
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: chosen.__setitem__(i, o[2]))
             for i, r in enumerate(moe.routers(policy))]
    try:
        for prompt, ids, routes in zip(prompts, out.ids, out.routes):
            tokens = prompt + ids
            assert routes.dtype == torch.uint8 and routes.shape == (len(tokens), 4, 2)
            assert (routes[-1] == moe.NOT_ROUTED).all() and (routes[:-1] != moe.NOT_ROUTED).all()
            with torch.no_grad():
                policy(torch.tensor([tokens]))
            own = torch.stack([chosen[i].reshape(len(tokens), 2) for i in range(4)], 1)[:-1]
            assert torch.equal(own.sort(-1).values, routes[:-1].long().sort(-1).values)
    finally:
        for h in hooks:
            h.remove()


@needs_vllm
def test_tiny_moe_trains_with_vllm_rollouts_replaying_vllms_routes(tmp_path):
    """Colocated: R3 replays vLLM's record in every pass; with R3 off the mismatch is the hand count; the engine
    holds the pushed experts (its greedy completions follow a change to the experts alone) and its routes are the
    policy's."""
    engine = dict(use_vllm=True, vllm_gpu_memory_utilization=0.1, router_aux_loss_coef=0.0,
                  vllm_engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 32 << 20})
    t, checked, grads = train_watched(GRPOConfig(output_dir=str(tmp_path / "r3"), router_replay="R3", **JOB,
                                                  **engine), replay=True)
    assert type(t.generator).__name__ == "VLLMEngine" and t.generator.routes_via == "hook"
    assert_replayed(t, checked, grads, metric_rows(tmp_path / "r3"))
    off, counts, _ = train_watched(GRPOConfig(output_dir=str(tmp_path / "off"), router_replay="off", **JOB,
                                              **engine), replay=False)
    assert_hand_count(counts, metric_rows(tmp_path / "off"))

    # The push carries the experts: after a large change to the policy's experts alone, vLLM's greedy completions
    # change and equal our sampler's on the changed policy, and its routes are the changed policy's.
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
    assert_routes_are_the_policys(t.generator, t.policy, prompts)


@needs_vllm
def test_a_vllm_server_returns_the_routes_and_takes_the_pushed_experts(tmp_path):
    """Server mode (`grpo vllm-serve` of tiny-moe): the routes travel in /generate's reply; R3 replays them in every
    pass and with R3 off the mismatch is the hand count, as colocated; weights pushed over the gloo group reach the
    server's experts: its greedy completions equal our sampler's on the policy, before and after a change to the
    experts alone."""
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
        def job(name, replay, **extra):
            return GRPOConfig(output_dir=str(tmp_path / name), router_replay=replay, router_aux_loss_coef=0.0,
                              use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
                              vllm_server_timeout=120, vllm_group_port=free_port(), **{**JOB, **extra})

        # (each run pushes its policy's weights to the server before its first rollout)
        t, checked, grads = train_watched(job("r3", "R3"), replay=True)
        assert_replayed(t, checked, grads, metric_rows(tmp_path / "r3"))
        _, counts, _ = train_watched(job("off", "off"), replay=False)
        assert_hand_count(counts, metric_rows(tmp_path / "off"))
        # Through the lag pipeline (max_staleness 1: each rollout sampled with the weights of the step before, in the
        # client thread): the routes ride with the rows and every pass replays them
        t, checked, grads = train_watched(job("lag", "R3", max_staleness=1, num_iterations=1, max_steps=3),
                                          replay=True)
        kinds = [kind for kind, _ in checked]
        assert kinds.count("update") >= 3 and "score" in kinds and all(n > 0 for _, n in checked), checked
        assert all(g > 0 for g in grads) and len(metric_rows(tmp_path / "lag")) == 3
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
        assert_routes_are_the_policys(client, policy, prompts)
    assert seen[0] != seen[1]


def test_routes_travel_in_the_servers_reply_as_bytes():
    """/generate's reply carries each row's (tokens, layers, k) uint8 routes as base64 bytes and hands them back
    exactly, split per part as the rows are; a request asks for them by name."""
    gen = torch.Generator().manual_seed(0)
    routes = [torch.randint(0, 4, (n, 4, 2), generator=gen, dtype=torch.uint8) for n in (5, 3)]
    routes[1][-1] = moe.NOT_ROUTED
    reply = GenerateReply(Completions([[1, 2], [3]], [False, True], [[-0.1, -0.2], [-0.3]], routes), 7)
    body = json.loads(json.dumps(reply.to_dict()))
    assert body["route_shape"] == [4, 2] and len(body["routes"][0]) == 4 * ((5 * 8 + 2) // 3)  # (base64: 4 per 3)
    back = GenerateReply.from_json(body)
    assert all(torch.equal(a, b) for a, b in zip(back.completions.routes, routes))
    parts = back.split([1, 1])
    assert [torch.equal(p.completions.routes[0], r) for p, r in zip(parts, routes)] == [True, True]
    assert "routes" not in GenerateReply(Completions([[1]], [False]), None).to_dict()
    request = GenerateRequest([[1]], SamplingParams(4), None, [0], routes=True)
    assert GenerateRequest.from_json(json.loads(json.dumps(request.to_dict()))).routes
    assert not GenerateRequest.from_json(GenerateRequest([[1]], SamplingParams(4), None, [0]).to_dict()).routes


def test_vllms_own_record_keeps_the_moe_layers_and_marks_the_last_token():
    """vLLM's `routed_experts` (a GPU build's Model Runner V2: not run here, the CPU build cannot start it) is
    (prompt + completion tokens - 1, every decoder layer, k), a dense layer's column zero: a row keeps the MoE
    layers' columns in order and NOT_ROUTED for the last token; the hook's pieces land at their positions, a later
    piece over the same positions (a preempted request run again) replacing the earlier."""
    record = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2) % 7  # 4 tokens run of 5; layers 0 and 2 MoE
    row = vllm_routes.recorded_row(record, [0, 2], 5)
    assert row.dtype == torch.uint8 and row.shape == (5, 2, 2)
    assert torch.equal(row[:4], torch.from_numpy(record[:, [0, 2]])) and (row[4] == moe.NOT_ROUTED).all()
    with pytest.raises(ValueError, match="expert id 255"):
        vllm_routes.recorded_row(np.full((1, 1, 2), 255, dtype=np.uint16), [0], 2)
    first, again = np.zeros((3, 1, 2), np.uint8), np.ones((2, 1, 2), np.uint8)
    row = vllm_routes.hooked_row([(0, first), (3, first[:1]), (0, again), (4, again)], 5, 1, 2)
    assert row[:, 0, 0].tolist() == [1, 1, 0, 0, moe.NOT_ROUTED]  # (the last token: never run)


def test_r3_with_a_vllm_engine_that_returns_no_routes_is_refused_by_name():
    """A vLLM build that cannot return routed experts (routes_support None) or an engine started without them:
    R3 refused with the reason; a served model with another number of MoE layers than the policy: refused."""
    policy = moe_policy()
    engine = object.__new__(VLLMEngine)
    engine.route_layers, engine.routes_missing = None, "the engine was started with enable_return_routed_experts: false"
    r3 = SimpleNamespace(router_replay="R3", router_aux_loss_coef=None)
    with pytest.raises(ConfigError, match="router_replay: R3 needs vLLM's routed experts, which this engine does not "
                                          "return \\(the engine was started with enable_return_routed_experts"):
        moe.make_routing(r3, policy, engine, object(), lambda x: x)
    off = SimpleNamespace(router_replay="off", router_aux_loss_coef=None)
    assert moe.make_routing(off, policy, engine, object(), lambda x: x) is not None  # (off: no record needed)
    engine.route_layers = 3
    with pytest.raises(ConfigError, match="returns routes of 3 MoE layers but Qwen3MoeForCausalLM has 2 routers"):
        moe.make_routing(off, policy, engine, object(), lambda x: x)


def moe_policy():
    from test_moe import tiny_moe

    return tiny_moe("qwen3_moe")
