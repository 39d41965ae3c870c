"""Mixture-of-Experts models: their routers, the router's load-balancing loss, and routing record and replay (R3).

transformers 5's MoE families (qwen3_moe, qwen2_moe, olmoe, mixtral, gpt_oss) route through a router module per
sparse layer (`*TopKRouter`) whose forward maps the layer's tokens (T, H) to (router logits (T, E), routing weights
(T, k), selected experts (T, k)); the experts then run on that selection. Everything here works through forward
hooks on those modules, so the model's own forward runs unchanged:

* **record** (`RouteRecorder`, in the rollout): each token's selected experts per layer, one uint8 per token x layer
  x k (`NOT_ROUTED` where the rollout never ran a token: padding, and a completion's last token when nothing
  followed it), `routes` (tokens, layers, k) per row; a vLLM engine returns the same record from vLLM's routers
  (grpo.engines.vllm_routes);
* **replay** (R3, arXiv 2510.11370; `RoutingPass` with `replay`): the router's selection is replaced by the rollout's,
  and its routing weights are recomputed from the live router logits with the model's own rule over the forced
  experts (`ROUTER_RULES`), so the loss's gradient still reaches the router's weights;
* **measure** (always, in the update): the share of tokens whose live selection differs from the rollout's in any
  layer (`moe/routing_mismatch`): with R3 off, the tokens trained under other experts than they were sampled with;
  with R3 on, the tokens whose routing replay overrode;
* **aux loss** (TRL's `router_aux_loss_coef`): the model's own load-balancing loss (its module's
  `load_balancing_loss_func`) over the router logits the update pass computed, weighted as TRL's padded batch
  weighs its tokens (`token_weights`), added to the loss as TRL adds it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

NOT_ROUTED = 255  # a route cell the rollout did not compute (uint8)

# Router class -> how its routing weights follow from its logits (T, E) and the chosen experts (T, k), as its own
# forward computes them (transformers 5.24's modeling files).
#   softmax:      softmax over all experts (float32), the chosen experts' probabilities, renormalised to sum to 1
#                 when the router's `norm_topk_prob` is set, in the logits' dtype
#   softmax_norm: the same, always renormalised and kept in float32 (Mixtral)
#   top_softmax:  softmax over the chosen experts' logits (gpt-oss)
ROUTER_RULES = {
    "Qwen3MoeTopKRouter": "softmax", "Qwen2MoeTopKRouter": "softmax", "OlmoeTopKRouter": "softmax",
    "MixtralTopKRouter": "softmax_norm", "GptOssTopKRouter": "top_softmax",
}


def routers(model) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (those of ROUTER_RULES); [] for a dense model."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_RULES]


def moe_config(model):
    """The text config of an MoE model (one that declares `output_router_logits`, TRL's test), else None."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return config if config is not None and hasattr(config, "output_router_logits") else None


def replay_weights(router, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The routing weights (T, k) `router` gives the experts `experts` (T, k) from its logits (T, E), by its own
    rule (ROUTER_RULES): differentiable in the logits."""
    rule = ROUTER_RULES[type(router).__name__]
    if rule == "top_softmax":
        top = logits.gather(-1, experts)
        return torch.softmax(top, dim=-1, dtype=top.dtype)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if rule == "softmax_norm" or getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights if rule == "softmax_norm" else weights.to(logits.dtype)


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T,) whether rows of a and b (T, k) choose the same set of experts (the order of the top-k is not a choice)."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


class RouteRecorder:
    """Records the experts each token of a rollout was routed to (a `TransformersSampler`'s forwards).

    The sampler calls `begin` for each batch of rows, then `prefill` after the prompts' forward and `step` after
    each one-token forward, and `finish` at the end; the hooks keep the last selection of each router."""

    def __init__(self, model):
        self.routers = routers(model)
        self.k = self.routers[0].top_k
        self.last: list[torch.Tensor | None] = [None] * len(self.routers)
        self.buf: torch.Tensor | None = None  # (n, P + max_new, layers, k) uint8
        self.handles: list = []

    def begin(self, n: int, prompt_width: int, max_new: int, device) -> None:
        self.buf = torch.full((n, prompt_width + max_new, len(self.routers), self.k), NOT_ROUTED, dtype=torch.uint8,
                              device=device)
        self.prompt_width = prompt_width

        def hook(layer):
            def keep(module, args, out):
                self.last[layer] = out[2]
            return keep

        self.handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]

    def prefill(self, copies: torch.Tensor | None) -> None:
        """After the prompts' forward over (n or the distinct prompts, P) tokens; `copies`: each row's distinct
        prompt (None: every row ran its own)."""
        P = self.prompt_width
        for layer, selected in enumerate(self.last):
            selected = selected.reshape(-1, P, self.k).to(torch.uint8)
            self.buf[:, :P, layer] = selected if copies is None else selected.index_select(0, copies)

    def step(self, rows, t: int) -> None:
        """After the one-token forward of completion token t of the batch rows `rows` (a slice or an index)."""
        for layer, selected in enumerate(self.last):
            self.buf[rows, self.prompt_width + t, layer] = selected.reshape(-1, self.k).to(torch.uint8)

    def finish(self, prompt_lengths: list[int], lengths: list[int]) -> list[torch.Tensor]:
        """Each row's routes (its prompt's tokens + its completion's, layers, k) uint8, on the CPU."""
        buf, P = self.buf.cpu(), self.prompt_width
        self.close()
        return [buf[i, P - p:P + c] for i, (p, c) in enumerate(zip(prompt_lengths, lengths))]

    def close(self) -> None:
        """Remove the hooks and drop the batch's record."""
        for h in self.handles:
            h.remove()
        self.handles, self.last, self.buf = [], [None] * len(self.routers), None


def batch_routes(routes: list[torch.Tensor], prompt_lengths: list[int], prompt_width: int,
                 columns: int) -> torch.Tensor:
    """The rows' routes laid out as the update's ids (N, columns = P+W) are: prompts left-padded to P =
    `prompt_width`, completions right-padded; NOT_ROUTED on padding. (N, P+W, layers, k) uint8."""
    layers, k = routes[0].shape[1:]
    out = torch.full((len(routes), columns, layers, k), NOT_ROUTED, dtype=torch.uint8)
    for i, (r, p) in enumerate(zip(routes, prompt_lengths)):
        out[i, prompt_width - p:prompt_width - p + r.shape[0]] = r
    return out


def packed_routes(routes: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The routes (n, S, layers, k) of a micro-batch in its packed layout: (R*L, layers, k), where `source` (R*L,)
    is each packed position's flat index into (n, S), -1 on padding (grpo.engines.packing.PackedRows.source)."""
    flat = routes.reshape(-1, *routes.shape[2:])
    out = flat.index_select(0, source.clamp(min=0))
    return out.masked_fill((source < 0)[:, None, None], NOT_ROUTED)


def token_weights(packed) -> torch.Tensor:
    """(R*L,) how many times TRL's padded batch holds each position of a packed micro-batch: a prompt shared by m
    completions m times, a completion token once, padding never. (TRL's batch also holds each completion's last
    token, which predicts nothing and so never enters the packed passes.) No host sync."""
    segments, branches = packed.segments.reshape(-1), packed.branches.reshape(-1)
    real, unit = segments >= 0, segments.clamp(min=0)
    prompt = real & (branches == 0)
    # A prompt's last position predicts the first token of each of its unit's completions: count those.
    predicted = torch.zeros_like(unit).scatter_add_(0, packed.score_index, torch.ones_like(packed.score_index))
    members = torch.zeros_like(unit).scatter_add_(0, unit, predicted * prompt)
    return torch.where(prompt, members[unit], real.long()).float()


def num_experts(config) -> int | None:
    """The experts per MoE layer a model's config declares (Mixtral's and OLMoE's name, or Qwen's), or None."""
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)


def aux_loss(model, logits: list[torch.Tensor], weights: torch.Tensor | None) -> torch.Tensor:
    """The model's own load-balancing loss (its modeling module's `load_balancing_loss_func`, which TRL's
    `outputs.aux_loss` is) of each layer's router logits (T, E), each token weighted by `weights` (T,) (None: 1)."""
    from accelerate.utils import extract_model_from_parallel

    base = extract_model_from_parallel(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    config = moe_config(base)
    experts = num_experts(config)
    # (the class's own modeling module: FSDP2 makes a subclass, FSDP<name>, in a module of its own)
    func = next(f for f in (getattr(sys.modules[c.__module__], "load_balancing_loss_func", None)
                            for c in type(base).__mro__) if f is not None)
    return func(tuple(logits), experts, config.num_experts_per_tok, weights)


@dataclass
class PassStats:
    """What one update pass saw: tokens both passes routed, those whose experts differ in some layer, the aux loss."""

    routed: torch.Tensor
    mismatched: torch.Tensor
    aux: torch.Tensor | None


class RoutingPass:
    """Hooks on `model`'s routers for one forward (and its backward's recomputation): with `routes` (T, layers, k)
    for the T tokens the pass computes, count the tokens whose live selection differs from them (`stats`) and, with
    `replay`, force them; with `collect_logits`, keep each layer's router logits (for the aux loss). `whole`: maps a
    layer's logits to the whole micro-batch's (a sequence-parallel slice's gathered over the group), or None."""

    def __init__(self, model, routes: torch.Tensor | None, replay: bool, collect_logits: bool,
                 whole: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.model, self.routers = model, routers(model)
        self.routes, self.replay, self.collect, self.whole = routes, replay, collect_logits, whole
        self.logits: list[torch.Tensor | None] = [None] * len(self.routers)
        self.differs = None
        self.handles: list = []

    def __enter__(self) -> "RoutingPass":
        if self.replay and self.routes is not None and not self.routers:
            raise RuntimeError(f"routing replay: {type(self.model).__name__} has no router grpo hooks "
                               f"({', '.join(ROUTER_RULES)}).")
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, layer: int) -> Callable:
        def hook(router, args, out):
            logits, weights, selected = out
            first = self.logits[layer] is None  # (a recomputation in backward sees the same tokens again)
            if first:
                self.logits[layer] = logits if self.collect else logits.new_empty(0)
            if self.routes is None:
                return None
            if self.routes.shape[0] != selected.shape[0]:
                raise RuntimeError(f"routing replay: the pass routes {selected.shape[0]} tokens but the rollout's "
                                   f"record holds {self.routes.shape[0]}; router_replay needs the padding-free "
                                   f"passes (use_remove_padding: true).")
            recorded = self.routes[:, layer].long()  # (T, k)
            known = (recorded != NOT_ROUTED).all(-1)
            if first:
                differs = ~same_experts(selected, recorded) & known
                self.differs = differs if self.differs is None else self.differs | differs
                self.known = known
            if not self.replay:
                return None
            forced = torch.where(known[:, None], recorded, selected)  # (unrecorded tokens keep their own)
            return logits, replay_weights(router, logits, forced), forced
        return hook

    def stats(self, weights: Callable[[int], torch.Tensor | None]) -> PassStats:
        """The pass's counts and, when logits were collected, its aux loss, each token weighted by
        `weights(tokens)` (None: 1)."""
        zero = torch.zeros((), dtype=torch.long)
        routed = self.known.sum() if self.differs is not None else zero
        mismatched = self.differs.sum() if self.differs is not None else zero
        aux = None
        if self.collect and self.logits and all(x is not None and x.numel() for x in self.logits):
            logits = self.logits if self.whole is None else [self.whole(x) for x in self.logits]
            aux = aux_loss(self.model, logits, weights(logits[0].shape[0]))
        return PassStats(routed, mismatched, aux)


REPLAY_MODES = {"off": "off", "disabled": "off", "R3": "R3", "r3": "R3"}
"""router_replay's values: off (verl's `disabled`), R3 (verl's `router_replay.mode: R3`; NeMo-RL's
`router_replay.enabled: true`; Megatron-LM's routing replay from the rollout)."""


class Routing:
    """A run's MoE handling in the update (`grpo.training.update.mechanics.Update.routing`): the routes replayed
    (`replay`), the aux loss added with weight `coef` (0: none), and the step's `moe/*` metrics. `sp`: this process's
    sequence-parallel group (grpo.engines.ulysses), whose passes each compute a slice of a packed micro-batch's
    tokens: the routes are sliced as the tokens are, the counts summed over the group, and the router logits gathered
    for the aux loss (a product of per-expert means: the slices' losses do not add up to the whole's)."""

    def __init__(self, replay: bool, coef: float, gather: Callable[[torch.Tensor], torch.Tensor], sp=None):
        self.replay, self.coef, self.gather, self.sp = replay, coef, gather, sp
        self._reset()

    def _reset(self) -> None:
        self.routed, self.mismatched, self.aux = [], [], []

    def routes(self, micro) -> torch.Tensor | None:
        """The rollout's routes of the tokens this process's pass over `micro` computes: all of them, or under
        sequence parallelism its slice of the packed row (NOT_ROUTED on the slice's padding)."""
        if micro.routes is None or self.sp is None or micro.packed is None:
            return micro.routes
        from grpo.engines.ulysses import local_rows

        return local_rows(micro.routes, self.sp, NOT_ROUTED)

    def score_pass(self, model, micro):
        """Around a no-gradient pass (old policy, reference): the rollout's routes forced with R3."""
        routes = self.routes(micro) if self.replay else None
        return RoutingPass(model, routes, True, False) if routes is not None else _NoPass()

    def update_pass(self, backend, model, micro, share: float) -> "_UpdatePass":
        """Around one micro-batch's forward and backward: the mismatch counted, the routes forced with R3, and
        coef x the aux loss x `share` (1 / (micro-batches x processes): TRL's per-micro-batch weight, under grpo's
        loss scaling) added to the loss in `backend.backward`."""
        whole = None
        if self.sp is not None and micro.packed is not None:  # the aux loss of the whole micro-batch on each process
            from grpo.engines.ulysses import gather_rows

            whole = lambda logits: gather_rows(logits, self.sp)[:micro.packed.tokens]  # noqa: E731 (padding cut)
        hooks = RoutingPass(model, self.routes(micro), self.replay, self.coef != 0, whole)
        return _UpdatePass(self, backend, hooks, micro, share)

    def step_metrics(self) -> dict[str, float]:
        """The optimizer step's `moe/aux_loss` (mean over its micro-batches, as TRL logs it) and
        `moe/routing_mismatch` (over every process's tokens); then reset."""
        out = {}
        if self.aux:
            out["moe/aux_loss"] = float(self.gather(torch.stack(self.aux).mean().reshape(1).cpu()).mean())
        if self.routed:
            counts = torch.stack([torch.stack(self.routed).sum(), torch.stack(self.mismatched).sum()])
            if self.sp is not None:  # (the group's processes counted the slices of the same tokens)
                torch.distributed.all_reduce(counts, group=self.sp.group)
            counts = counts.cpu()
            routed, mismatched = self.gather(counts.reshape(1, 2)).reshape(-1, 2).sum(0).tolist()
            if routed:
                out["moe/routing_mismatch"] = mismatched / routed
        self._reset()
        return out


class _NoPass:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class _UpdatePass:
    def __init__(self, routing: Routing, backend, hooks: RoutingPass, micro, share: float):
        self.routing, self.backend, self.hooks, self.micro, self.share = routing, backend, hooks, micro, share

    def __enter__(self):
        self.hooks.__enter__()
        self.backend.extra_loss = self._extra
        return self

    def __exit__(self, *exc):
        self.backend.extra_loss = None
        self.hooks.__exit__(*exc)

    def _extra(self) -> torch.Tensor | None:
        stats = self.hooks.stats(lambda tokens: pass_weights(self.micro, tokens))
        if self.hooks.routes is not None:
            self.routing.routed.append(stats.routed.detach())
            self.routing.mismatched.append(stats.mismatched.detach())
        if stats.aux is None:
            return None
        self.routing.aux.append(stats.aux.detach().float())
        return self.routing.coef * stats.aux * self.share


def pass_weights(micro, tokens: int) -> torch.Tensor | None:
    """Each of a pass's `tokens` router rows' weight in TRL's batch: `token_weights` of a packed micro-batch; the
    attention mask of a padded one (with or without its last column, as the pass ran it)."""
    if micro.packed is not None and micro.packed.input_ids.numel() == tokens:
        return token_weights(micro.packed)
    mask = micro.attention_mask
    if mask.numel() == tokens:
        return mask.reshape(-1).float()
    if mask[:, :-1].numel() == tokens:
        return mask[:, :-1].reshape(-1).float()
    return None


def make_routing(cfg, policy, generator, packing, gather, sp=None, multi_turn: bool = False) -> Routing | None:
    """The run's `Routing` for `policy`, or None for a dense model; the sampler `generator` records routes when it
    is grpo's own (in a rollout worker, max_staleness > 0, its forked copy records), or returns vLLM's. `sp`: the process's
    sequence-parallel group, or None; `multi_turn`: the rollouts are multi-turn (their rows carry no routes). What
    cannot combine is refused by name (a ConfigError)."""
    from grpo.config import ConfigError
    from grpo.engines.base import ReturnsRoutes
    from grpo.engines.sampling import TransformersSampler
    from grpo.engines.sharding import WholeWeightsSampler

    config, mode, coef = moe_config(policy), REPLAY_MODES[cfg.router_replay], cfg.router_aux_loss_coef
    name = type(policy).__name__
    if config is None:
        if coef or mode == "R3":
            key = "router_aux_loss_coef" if coef else "router_replay"
            raise ConfigError(f"{key}: {name} is not a Mixture-of-Experts model (its config declares no "
                              f"output_router_logits); leave {key} at its default.")
        return None
    coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if not routers(policy):
        if mode == "R3" or cfg.router_aux_loss_coef:
            raise ConfigError(f"router_replay / router_aux_loss_coef: {name}'s routers are none grpo hooks "
                              f"({', '.join(ROUTER_RULES)}); set router_replay: off and router_aux_loss_coef: 0.")
        return None
    if isinstance(generator, WholeWeightsSampler):  # (sharded weights gathered for grpo's sampler: it records)
        generator = generator.sampler
    from_vllm = isinstance(generator, ReturnsRoutes)  # (vLLM's engines: routes from vLLM's routers, or none)
    layers = generator.route_layers if from_vllm else None
    if layers is not None and layers != len(routers(policy)):
        raise ConfigError(f"use_vllm: the vLLM engine returns routes of {layers} MoE layers but {name} has "
                          f"{len(routers(policy))} routers; serve the same model as the policy.")
    experts = num_experts(config) or 0
    if mode == "R3":
        missing = generator.routes_missing if from_vllm else ""
        refusals = [(experts >= NOT_ROUTED, f"records an expert's id in a byte, which holds ids below {NOT_ROUTED}, "
                                            f"and {name} has {experts} experts"),
                    (multi_turn, "replays the routes of single-turn rollouts; multi-turn rollouts (tools, "
                                 "environments, rollout_func, agents) do not record them"),(from_vllm and layers is None, f"needs vLLM's routed experts, which this engine does not return "
                                                   f"({missing}); set use_vllm: false"),
                    (not from_vllm and not isinstance(generator, TransformersSampler),
                     "records routes in grpo's own samplers and vLLM's, not in a user's engine"),
                    (packing is None, "replays through the padding-free passes; set use_remove_padding: true with "
                                      "an attention that packs (sdpa, eager, flash)")]
        for refused, why in refusals:
            if refused:
                raise ConfigError(f"router_replay: R3 {why}, or router_replay: off.")
    if isinstance(generator, TransformersSampler) and experts < NOT_ROUTED:  # (a byte a route cell: ids < 255)
        generator.routes = RouteRecorder(policy)
    return Routing(mode == "R3", float(coef), gather, sp)
