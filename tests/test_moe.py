"""Mixture-of-Experts models (grpo.engines.moe): transformers' MoE families train on both engines with padding-free
passes; the router's load-balancing loss is TRL's and the model's own; routing replay (R3) forces the rollout's
experts in the training passes while the router still learns, and with it off the routing mismatch is counted."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.engines import moe
from grpo.engines.base import SamplingParams
from grpo.engines.packing import choose_packing, pack
from grpo.engines.policy import MicroBatch, completion_logprobs
from grpo.engines.sampling import TransformersSampler
from conftest import build_char_tokenizer, load_script  # (at the top: tests/trl_suite has a conftest too)

FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss")


def tiny_moe(family: str, vocab: int = 40, seed: int = 0, pad: int = 1, eos: int = 0):
    """A 2-layer, 16-wide model of `family` with 4 experts, top-2 (a shared expert for qwen2_moe), float32."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2, pad_token_id=pad, eos_token_id=eos,
                  bos_token_id=None, max_position_embeddings=64)
    config = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=8, num_experts=4,
                                                         norm_topk_prob=True),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, moe_intermediate_size=8, num_experts=4,
                                                         shared_expert_intermediate_size=8),
        "olmoe": lambda: transformers.OlmoeConfig(**common, intermediate_size=8, num_experts=4),
        "mixtral": lambda: transformers.MixtralConfig(**common, intermediate_size=8, num_local_experts=4),
        "gpt_oss": lambda: transformers.GptOssConfig(**common, head_dim=8, intermediate_size=8, num_local_experts=4,
                                                     sliding_window=8, layer_types=["sliding_attention",
                                                                                    "full_attention"]),
    }[family]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for router in moe.routers(model):  # (some families initialise routers to zero: every expert tied)
        torch.nn.init.normal_(router.weight, std=0.5)
    return model


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Each family's tiny model saved with the byte tokenizer of tests/conftest.py (258 tokens)."""

    dirs = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        tok = build_char_tokenizer(path)
        tiny_moe(family, len(tok), pad=tok.pad_token_id, eos=tok.eos_token_id).save_pretrained(path)
        dirs[family] = str(path)
    return dirs


def length(completions, **kwargs):
    return [len(c) / 6 for c in completions]


def train(model_dir, out, **overrides):
    values = dict(output_dir=str(out), task=None, num_generations=4, prompts_per_step=2, max_completion_length=6,
                  learning_rate=1e-2, beta=0.04, max_steps=2, save_steps=0, report_to=[], log_completions_steps=0,
                  seed=0, per_device_train_batch_size=4, num_iterations=2)
    values.update(overrides)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[length], args=GRPOConfig(**values),
                          train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}))
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return trainer, [r for r in rows if "moe/routing_mismatch" in r]


# ---- the families on both engines -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_weights_are_the_routers_own_for_its_own_choice(family):
    """Replay recomputes the routing weights by each family's own rule: given the experts the router chose itself,
    they are the router's own weights (to float32 rounding: the same operations in the same order)."""
    model = tiny_moe(family)
    router = moe.routers(model)[0]
    hidden = torch.randn(7, 16)
    logits, weights, chosen = router(hidden)
    torch.testing.assert_close(moe.replay_weights(router, logits, chosen), weights, rtol=0, atol=1e-7)


@pytest.mark.parametrize("engine", ["cpu", "transformers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_families_train_padding_free_on_both_engines(family, engine, moe_dirs, tmp_path):
    """Each family trains through the engine's padding-free passes, the rollout's routes recorded for every token the
    rollout ran: the first update (same weights as the rollout) routes them as the rollout did; the second, one
    optimizer step later, is measured too; the load-balancing loss is logged and finite."""
    trainer, rows = train(moe_dirs[family], tmp_path / "run", engine=engine)
    assert trainer.engine.name == engine and trainer.micro.packing is not None
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["moe/routing_mismatch"] == 0.0  # (no weight changed between the rollout and this pass)
    assert all(torch.isfinite(torch.tensor(r["moe/aux_loss"])) and r["moe/aux_loss"] > 0 for r in rows)


def test_the_shipped_tiny_moe_loads_and_trains(tmp_path):
    """grpo/assets/tiny-moe: a Qwen3-MoE model small enough to ship, loaded by name, trained a step on the CPU."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from grpo.config.base import ASSETS

    path = ASSETS / "tiny-moe"
    assert sum(f.stat().st_size for f in Path(path).iterdir()) < 6e6
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and len(moe.routers(model)) == model.config.num_hidden_layers
    trainer = GRPOTrainer(args=GRPOConfig(output_dir=str(tmp_path / "run"), model_name_or_path="tiny-moe",
                                          task="arithmetic", max_steps=1, num_generations=4, prompts_per_step=2,
                                          max_completion_length=16, save_steps=0, report_to=[],
                                          log_completions_steps=0, router_replay="R3"))
    assert trainer.train().global_step == 1


# ---- the load-balancing loss ----------------------------------------------------------------------------------

def test_aux_loss_by_hand():
    """E=2 experts, top-1, one layer; token a's probabilities (3/4, 1/4) pick expert 0, token b's (1/4, 3/4) expert 1.
    The loss is E x sum_e f_e P_e with f_e the (weighted) share of tokens sent to e and P_e the mean probability:
    weights (1, 1): f = P = (1/2, 1/2), 2 x (1/4 + 1/4) = 1. Weights (3, 1) (a prompt token shared by 3 rows):
    f = (3/4, 1/4), P = ((3 x 3/4 + 1/4) / 4, (3 x 1/4 + 3/4) / 4) = (5/8, 3/8), 2 x (15/32 + 3/32) = 9/8."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                               num_key_value_heads=1, head_dim=8, moe_intermediate_size=4,
                                               num_experts=2, num_experts_per_tok=1))
    ln3 = torch.log(torch.tensor(3.0))
    logits = [torch.tensor([[ln3, 0.0], [0.0, ln3]])]
    assert moe.aux_loss(model, logits, torch.tensor([1.0, 1.0])).item() == pytest.approx(1.0, abs=1e-6)
    assert moe.aux_loss(model, logits, torch.tensor([3.0, 1.0])).item() == pytest.approx(9 / 8, abs=1e-6)


def test_packed_token_weights_count_each_shared_prompt_once_per_row():
    """Two rows share a 3-token prompt (completions of 3 and 2 tokens), a third has its own 2-token prompt and a
    2-token completion. Packed with shared prompts, each prompt token stands for the rows that share it (2, and 1),
    each completion token that enters the model (all but its last) for 1, padding for 0."""
    ids = torch.tensor([[5, 6, 7, 10, 11, 12], [5, 6, 7, 13, 14, 0], [0, 8, 9, 15, 16, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0]])
    packed = pack(ids, mask, 3, choose_packing(tiny_moe("qwen3_moe"))[0])
    weights = moe.token_weights(packed)
    real = packed.source >= 0
    by_token = {int(ids.reshape(-1)[s]): float(w) for s, w in zip(packed.source[real], weights[real])}
    assert by_token == {5: 2, 6: 2, 7: 2, 10: 1, 11: 1, 13: 1, 8: 1, 9: 1, 15: 1}
    assert float(weights[~real].sum()) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_loss_is_the_models_own_on_the_same_batch(family):
    """TRL takes `outputs.aux_loss` of the model's forward with output_router_logits (TRL 1.16
    `_get_per_token_logps_and_entropies`): grpo's, from the router logits its hooks catch in a pass over the same
    padded batch, weighted by the attention mask, is that number."""
    model = tiny_moe(family)
    ids = torch.randint(2, 40, (3, 6))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    theirs = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    with moe.RoutingPass(model, None, False, True) as hooks:
        model(input_ids=ids, attention_mask=mask)
    ours = hooks.stats(lambda tokens: mask.reshape(-1).float()).aux
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_aux_loss_enters_the_loss_as_trl_adds_it():
    """TRL 1.16 adds router_aux_loss_coef x aux_loss / gradient_accumulation_steps to each micro-batch's loss
    (`_compute_loss`); grpo adds coef x aux x 1 / (micro-batches x processes), its loss being scaled by the
    processes in backward (DDP's mean undone): on one process the same term, checked against TRL's own code."""
    from trl_reference import trl_loss

    torch.manual_seed(0)
    logp, mask, adv = torch.randn(4, 5), torch.ones(4, 5), torch.randn(4)
    aux, coef, accumulation = torch.tensor(2.25), 0.01, 2
    plain, _ = trl_loss(logp, logp.neg(), logp, None, adv, mask, gradient_accumulation_steps=accumulation)
    with_aux, metrics = trl_loss(logp, logp.neg(), logp, None, adv, mask, gradient_accumulation_steps=accumulation,
                                 aux=(aux, coef))
    routing = moe.Routing(False, coef, lambda t: t)

    class Backend:
        extra_loss = None

    hooks = moe.RoutingPass(tiny_moe("qwen3_moe"), None, False, True)
    hooks.stats = lambda weights: moe.PassStats(torch.tensor(0), torch.tensor(0), aux)
    backend, micro = Backend(), MicroBatch(torch.zeros(1, 1), torch.ones(1, 1), 1)
    with moe._UpdatePass(routing, backend, hooks, micro, share=1 / (accumulation * 1)):
        ours = backend.extra_loss()
    torch.testing.assert_close(with_aux - plain, ours, rtol=1e-6, atol=1e-9)
    assert metrics["aux_loss"] == pytest.approx(2.25) and routing.step_metrics()["moe/aux_loss"] == 2.25


# ---- routing record and replay --------------------------------------------------------------------------------

def rollout_and_micro_batch(model):
    """A rollout of 2 prompts x 2 completions from `model` with its routes recorded, as one packed micro-batch."""
    sampler = TransformersSampler(model, pad_id=1, eos_ids=[0])
    sampler.routes = moe.RouteRecorder(model)
    prompts = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]]
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=5), seeds=[1, 2, 3, 4])
    from grpo.training.rollout.batch import pack as pad_rows

    ids, mask, _ = pad_rows(prompts, out.ids, 1, [True] * 4)
    width = ids.shape[1] - 3
    routes = moe.batch_routes(out.routes, [3, 3, 2, 2], 3, ids.shape[1])
    packed = pack(ids, mask, width, choose_packing(model)[0])
    micro = MicroBatch(ids, mask, width, packed=packed, routes=moe.packed_routes(routes, packed.source))
    return out, micro


def experts_seen(model, micro, replay: bool):
    """The experts each layer's experts module ran for each token of the micro-batch's packed pass (under replay
    or not), and the pass's mismatch count; the log-probs' sum backpropagated."""
    seen = {}
    handles = [layer.mlp.experts.register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(i, args[1].clone())) for i, layer in enumerate(model.model.layers)]
    try:
        with moe.RoutingPass(model, micro.routes, replay, False) as hooks:
            logp = completion_logprobs(model, micro.input_ids, micro.attention_mask, micro.width, 1.0,
                                       packed=micro.packed)
            logp.sum().backward()
    finally:
        for h in handles:
            h.remove()
    return seen, hooks.stats(lambda tokens: None)


def test_r3_trains_under_the_rollouts_experts_and_the_router_still_learns():
    """The router is perturbed after the rollout so that it routes otherwise; under replay every token the rollout
    ran goes, in every layer, to the experts it went to in the rollout, and the routers' weights get gradient."""
    model = tiny_moe("qwen3_moe")
    out, micro = rollout_and_micro_batch(model)
    with torch.no_grad():
        for router in moe.routers(model):
            router.weight.add_(torch.randn_like(router.weight))
    seen, stats = experts_seen(model, micro, replay=True)
    known = (micro.routes != moe.NOT_ROUTED).all(-1).all(-1)  # (T,): tokens the rollout ran
    assert torch.equal(known, micro.packed.source >= 0)  # (every token the pass computes; padding not)
    for layer, experts in seen.items():
        assert torch.equal(experts[known].sort(-1).values, micro.routes[known, layer].long().sort(-1).values)
    assert int(stats.mismatched) > 0  # (the perturbed router would have routed some otherwise)
    for router in moe.routers(model):
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0


def test_without_replay_the_mismatch_is_the_hand_count():
    """With R3 off the pass routes by itself; the tokens counted as mismatched are those whose expert set differs
    from the rollout's in some layer, counted here token by token from the routers' own outputs."""
    model = tiny_moe("qwen3_moe")
    _, micro = rollout_and_micro_batch(model)
    with torch.no_grad():
        for router in moe.routers(model):
            router.weight.add_(0.5 * torch.randn_like(router.weight))
    live = {}

    def keep(layer):
        def hook(module, args, out):
            live.setdefault(layer, out[2].clone())  # (the first pass's: not backward's recomputation)
        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(moe.routers(model))]
    seen, stats = experts_seen(model, micro, replay=False)
    for h in handles:
        h.remove()
    count = routed = 0
    for t in range(micro.routes.shape[0]):
        if (micro.routes[t] == moe.NOT_ROUTED).any():
            continue
        routed += 1
        count += any(set(live[layer][t].tolist()) != set(micro.routes[t, layer].tolist()) for layer in live)
    assert (int(stats.routed), int(stats.mismatched)) == (routed, count) and 0 < count < routed


def test_r3_and_off_log_the_mismatch_and_r3_changes_the_update(moe_dirs, tmp_path):
    """On the trainer: the second optimizer step of a rollout routes some tokens otherwise (its weights moved);
    with R3 those tokens are trained under the rollout's experts, so the two runs' weights differ."""
    off, rows_off = train(moe_dirs["qwen3_moe"], tmp_path / "off", router_replay="off", beta=0.0)
    on, rows_on = train(moe_dirs["qwen3_moe"], tmp_path / "on", router_replay="R3", beta=0.0)
    assert rows_off[1]["moe/routing_mismatch"] > 0 and rows_on[1]["moe/routing_mismatch"] > 0
    diff = max((a - b).abs().max().item() for a, b in zip(off.policy.parameters(), on.policy.parameters()))
    assert diff > 1e-6


def test_what_cannot_combine_is_refused_by_name(moe_dirs, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="router_replay: R3 replays through the padding-free passes"):
        train(moe_dirs["qwen3_moe"], tmp_path / "a", router_replay="R3", use_remove_padding=False)
    with pytest.raises(ConfigError, match="router_aux_loss_coef: Qwen2ForCausalLM is not a Mixture-of-Experts"):
        train(tiny_model_dir, tmp_path / "b", router_aux_loss_coef=0.01)
    with pytest.raises(ConfigError, match="router_replay"):
        GRPOConfig(output_dir=str(tmp_path / "c"), router_replay="R2")
    # YAML and the command line read `off` as false; NeMo-RL's `enabled: true` is R3
    assert GRPOConfig.from_dict({"router_replay": False}).router_replay == "off"
    assert GRPOConfig.from_dict({"router_replay": True}).router_replay == "R3"


def test_the_record_is_one_byte_per_token_layer_and_expert():
    model = tiny_moe("qwen3_moe")
    out, _ = rollout_and_micro_batch(model)
    for prompt, ids, routes in zip([3, 3, 2, 2], out.ids, out.routes):
        assert routes.dtype == torch.uint8 and routes.shape == (prompt + len(ids), 2, 2)


def test_the_tiny_moe_build_script_is_deterministic_at_miniature_size(tmp_path):
    """scripts/build_tiny_moe_model.py --tiny: the same weights twice, a Qwen3-MoE checkpoint that loads, and a
    PROVENANCE.md that names the command and the experts."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM


    script = load_script("build_tiny_moe_model")
    script.main(["--out", str(tmp_path / "a"), "--tiny"])
    script.main(["--out", str(tmp_path / "b"), "--tiny"])
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == script.TINY["experts"]
    text = (tmp_path / "a" / "PROVENANCE.md").read_text()
    assert "python scripts/build_tiny_moe_model.py --out" in text and "4 experts of width 16, top-2" in text


def test_r3_refuses_what_it_cannot_combine_with():
    """make_routing refuses R3, by name, beside a rollout engine that records no routes (a user's; vLLM's that
    return none: tests/test_vllm_moe.py), padded passes, multi-turn rollouts and more experts than a byte names; sequence parallelism and a rollout worker (max_staleness) take it (tests/test_moe_pipeline.py)."""
    from types import SimpleNamespace

    model = tiny_moe("qwen3_moe")
    sampler, packing = TransformersSampler(model, 1, [0]), choose_packing(model)[0]
    cfg = dict(router_replay="R3", router_aux_loss_coef=None, sequence_parallel_size=1, max_staleness=0)
    cases = [(dict(), object(), packing, "records routes in grpo's own samplers and vLLM's, not in a user's engine"),
             (dict(), sampler, None, "replays through the padding-free passes")]
    for overrides, generator, packs, message in cases:
        with pytest.raises(ConfigError, match=message):
            moe.make_routing(SimpleNamespace(**{**cfg, **overrides}), model, generator, packs, lambda t: t)
    with pytest.raises(ConfigError, match="R3 replays the routes of single-turn rollouts; multi-turn"):
        moe.make_routing(SimpleNamespace(**cfg), model, sampler, packing, lambda t: t, multi_turn=True)
    # (a route cell is a byte and 255 marks a token not routed: 300 experts cannot be recorded, R3 or not)
    many = tiny_moe("qwen3_moe")
    many.config.num_experts = 300
    with pytest.raises(ConfigError, match="holds ids below 255, and Qwen3MoeForCausalLM has 300 experts"):
        moe.make_routing(SimpleNamespace(**cfg), many, TransformersSampler(many, 1, [0]), packing, lambda t: t)
    unrecorded = TransformersSampler(many, 1, [0])
    moe.make_routing(SimpleNamespace(**{**cfg, "router_replay": "off"}), many, unrecorded, packing, lambda t: t)
    assert unrecorded.routes is None
    routing = moe.make_routing(SimpleNamespace(**cfg), model, sampler, packing, lambda t: t)
    assert routing.replay and routing.coef == model.config.router_aux_loss_coef  # (null: the model's own)
    for overrides in (dict(sequence_parallel_size=2), dict(max_staleness=1)):
        assert moe.make_routing(SimpleNamespace(**{**cfg, **overrides}), model, sampler, packing, lambda t: t).replay
    assert isinstance(sampler.routes, moe.RouteRecorder)


def test_the_scoring_passes_replay_too():
    """The no-gradient passes (old policy, reference) run under R3 with the rollout's experts: a reference whose
    routers differ from the policy's still sends every token to the rollout's experts."""
    import copy

    model = tiny_moe("qwen3_moe")
    _, micro = rollout_and_micro_batch(model)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for router in moe.routers(reference):
            router.weight.add_(torch.randn_like(router.weight))
    seen = {}
    handles = [layer.mlp.experts.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, args[1].clone()))
               for i, layer in enumerate(reference.model.layers)]
    routing = moe.Routing(True, 0.0, lambda t: t)
    with torch.no_grad(), routing.score_pass(reference, micro):
        completion_logprobs(reference, micro.input_ids, micro.attention_mask, micro.width, 1.0, packed=micro.packed)
    for h in handles:
        h.remove()
    known = micro.packed.source >= 0
    for layer, experts in seen.items():
        assert torch.equal(experts[known].sort(-1).values, micro.routes[known, layer].long().sort(-1).values)


def test_a_vllm_that_refuses_its_routed_experts_record_still_starts_without_routes(monkeypatch):
    """vLLM's own record (enable_return_routed_experts) needs its Model Runner V2, which some settings turn off: vLLM
    then refuses the option when it checks its config. The engine starts again without it and records no routes
    (R3 refused with vLLM's reason), rather than failing for an MoE with router_replay off. A fake vLLM here: the
    real GPU build is not installed on this machine."""
    import sys
    from types import ModuleType, SimpleNamespace

    from grpo.engines import vllm as vllm_engine
    from grpo.engines import vllm_routes

    starts = []

    class LLM:
        def __init__(self, **kwargs):
            starts.append(kwargs)
            if kwargs.get("enable_return_routed_experts"):
                raise ValueError("AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.")
            self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 32))

    fake = ModuleType("vllm")
    fake.LLM, fake.__version__ = LLM, "0.32.0"
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_sleep_mode_available=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: fake)
    monkeypatch.setattr(vllm_routes, "route_plan", lambda vllm, model, wanted, config=None: ("vllm", ""))
    engine = vllm_engine.VLLMEngine("some-moe", eos_ids=[0])
    assert [s.get("enable_return_routed_experts") for s in starts] == [True, None]
    assert engine.route_layers is None and "AuxOutput Connector requires Model Runner V2" in engine.routes_missing
