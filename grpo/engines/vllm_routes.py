"""An MoE rollout's routes from vLLM: the experts each token of each row was routed to, per MoE layer, in the layout
grpo's own samplers record (`grpo.engines.moe.RouteRecorder`: (prompt + completion tokens, layers, k) uint8 per row,
`NOT_ROUTED` where vLLM ran no forward for a token: a completion's last token, a prompt block served from the prefix
cache by the CPU build's hook), so that routing replay (R3) and `moe/routing_mismatch` work with vLLM rollouts.

Two ways, chosen when the engine starts (`routes_support`):

* **vLLM's own record** (`enable_return_routed_experts`, `CompletionOutput.routed_experts`): a numpy array
  (prompt + completion tokens - 1, every decoder layer, k) of global expert ids, captured in each MoE router
  before any expert-parallel load balancing remaps them, blocks served from the prefix cache included. vLLM 0.32.0
  fills it only in its Model Runner V2, which needs Triton: GPU builds. grpo keeps the MoE layers' columns.
* **grpo's hook** (vLLM's CPU build, whose model runner is V1: vLLM refuses `enable_return_routed_experts` there,
  "AuxOutput Connector requires Model Runner V2", and V2 refuses to start without Triton, which the CPU build lacks).
  grpo sets each MoE layer's router `capture_fn` (the callback vLLM's own capturer uses,
  `BaseRouter._select_experts`, called with the global expert ids) and wraps the model runner's `_model_forward`,
  which knows the step's requests, where each one's tokens lie in the flattened batch and the position of the
  first (`input_batch.req_ids`, `query_start_loc`, `num_computed_tokens_cpu`); each step's ids go to the host once.
  Tokens vLLM takes from its prefix cache are never run, so the engine starts with `enable_prefix_caching: false`
  (unless set): every row's prompt is computed, and routed, in its own request. And a compiled model (torch.compile
  traces the routers with the hook disarmed) never calls the callback, so the engine starts eager
  (`enforce_eager: true`, unless set; a forward without the callbacks stops the run, saying so).
"""

from __future__ import annotations

import numpy as np
import torch

from grpo.engines.moe import NOT_ROUTED, num_experts


def routes_support() -> str | None:
    """How this vLLM build can return an MoE rollout's routes: "vllm" (its own record: Model Runner V2, which
    needs Triton), "hook" (grpo's hook on the CPU build's V1 model runner), or None (neither, or a vLLM whose
    modules are laid out otherwise than 0.32.0's)."""
    try:
        import vllm.config
        from vllm import envs
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    own = hasattr(getattr(vllm.config, "AuxOutputConfig", None), "enable_return_routed_experts")
    if own and HAS_TRITON and getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None) is not False:
        return "vllm"

    if current_platform.is_cpu() and hasattr(BaseRouter, "set_capture_fn") and hasattr(GPUModelRunner,
                                                                                      "_model_forward"):
        return "hook"
    return None


def route_plan(vllm, model_name_or_path: str, wanted: bool | None, config=None) -> tuple[str | None, str]:
    """How an engine for `model_name_or_path` records routes ("vllm", "hook" or None: `routes_support`), and when
    it does not, why (for the refusal of R3). `wanted`: the engine's `enable_return_routed_experts` setting (None:
    on for an MoE where the build can, False: off, True: on or an error). `config`: the model's (the policy's, when
    the engine is given it), else read from `model_name_or_path`, only when the build can record at all (a Hub name
    is fetched over the network)."""
    from transformers import AutoConfig

    how, why, unread = routes_support(), "", ""
    if how is None and not wanted:
        version = getattr(vllm, "__version__", "")
        return None, (f"vLLM {version} returns them from its Model Runner V2 only, which needs Triton, and grpo's "
                      f"hook needs the CPU build's V1 model runner")
    if config is None:
        try:
            config = AutoConfig.from_pretrained(model_name_or_path)
        except (OSError, ValueError, KeyError) as err:  # (a config only its own code reads: no router grpo knows)
            unread = f"{model_name_or_path}'s config does not load in transformers ({err})"
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = num_experts(config) if hasattr(config, "output_router_logits") else None
    if config is None:
        how, why = None, unread
    elif wanted is False:
        how, why = None, "the engine was started with enable_return_routed_experts: false"
    elif experts is None:
        how, why = None, f"{model_name_or_path} is not a Mixture-of-Experts model"
    elif experts >= NOT_ROUTED:
        how, why = None, f"{experts} experts per layer: grpo's record keeps expert ids below {NOT_ROUTED}"
    elif how is None:
        why = (f"vLLM {vllm.__version__} returns them from its Model Runner V2 only, which needs Triton, and grpo's "
               f"hook needs the CPU build's V1 model runner")
    if wanted and how is None:
        raise ValueError(f"enable_return_routed_experts: this engine cannot return routed experts ({why})")
    return how, why


def _moe_runners(model) -> list:
    """The model's MoE layers (vLLM's `MoERunner`s) in layer order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)


def moe_layer_ids(worker) -> list[int]:
    """(In each vLLM worker) the decoder-layer index of each MoE layer, in order: the columns of vLLM's record that
    are MoE layers (it has one per decoder layer, a dense layer's left zero)."""
    return [m.layer_id for m in _moe_runners(worker.model_runner.model)]


class RouteHook:
    """grpo's record of a V1 model runner's routing (module docstring): `rows[request id]` is a list of (position of
    the first token, (tokens, layers, k) uint8) per forward that ran some of the request's tokens."""

    def __init__(self, runner):
        self.runners = _moe_runners(runner.model)
        self.selected: list[torch.Tensor | None] = [None] * len(self.runners)
        self.armed, self.rows = False, {}
        for layer, module in enumerate(self.runners):
            module.router.set_capture_fn(self._capturer(layer))
        forward = runner._model_forward

        def model_forward(*args, **kwargs):
            batch = runner.input_batch
            n = batch.num_reqs
            requests, bounds = list(batch.req_ids[:n]), runner.query_start_loc.np[:n + 1].copy()
            starts = batch.num_computed_tokens_cpu[:n].copy()
            self.armed = True
            try:
                out = forward(*args, **kwargs)
            finally:
                self.armed = False
            self._keep(requests, bounds, starts)
            return out

        runner._model_forward = model_forward

    def _capturer(self, layer: int):
        def capture(topk_ids: torch.Tensor) -> None:
            if self.armed:
                self.selected[layer] = topk_ids
        return capture

    def _keep(self, requests: list[str], bounds: np.ndarray, starts: np.ndarray) -> None:
        selected, self.selected = self.selected, [None] * len(self.runners)
        if any(s is None for s in selected):
            raise RuntimeError("vLLM ran a forward without calling every MoE router's capture hook (a compiled "
                               "graph runs without Python callbacks); set vllm_engine_kwargs: {enforce_eager: true}")
        tokens = int(bounds[-1])
        step = torch.stack([s[:tokens] for s in selected], 1).to(torch.uint8).cpu().numpy()  # (one copy a step)
        for request, a, b, start in zip(requests, bounds[:-1], bounds[1:], starts):
            self.rows.setdefault(request, []).append((int(start), step[a:b]))


def install_route_hook(worker) -> int:
    """(In each vLLM worker) grpo's hook on the model runner; the MoE layers it records, 0 (and no hook) where a
    layer's routing does not go through a router with vLLM's capture callback (a kernel that routes inside itself,
    vLLM's `is_monolithic`), or there is no MoE layer (a model run through another implementation)."""
    runner = worker.model_runner
    if not hasattr(runner, "grpo_routes"):
        layers = _moe_runners(runner.model)
        if not layers or any(m.is_monolithic or not hasattr(m.router, "set_capture_fn") for m in layers):
            return 0
        runner.grpo_routes = RouteHook(runner)
    return len(runner.grpo_routes.runners)


def take_hooked_routes(worker) -> dict[str, list]:
    """(In each vLLM worker) what the hook recorded since the last call, by vLLM's request id; then forgotten."""
    hook = worker.model_runner.grpo_routes
    rows, hook.rows = hook.rows, {}
    return rows


def hooked_row(pieces: list, tokens: int, layers: int, k: int) -> torch.Tensor:
    """One row's (tokens, layers, k) uint8 routes from the hook's pieces (position, rows); a later piece over the
    same positions (a request preempted and run again) replaces an earlier one; NOT_ROUTED where none ran, and on
    the last token, which no forward ran (a speculative step's rejected draft may have left rows there)."""
    out = np.full((tokens, layers, k), NOT_ROUTED, dtype=np.uint8)
    for start, rows in pieces:
        rows = rows[:max(tokens - 1 - start, 0)]
        out[start:start + len(rows)] = rows
    return torch.from_numpy(out)


def recorded_row(routed_experts: np.ndarray, moe_layers: list[int], tokens: int) -> torch.Tensor:
    """One row's (tokens, MoE layers, k) uint8 routes from vLLM's `routed_experts` (tokens - 1 or fewer, every
    decoder layer, k): its MoE layers' columns, NOT_ROUTED for the tokens it has no row for (the last)."""
    if routed_experts.max(initial=0) >= NOT_ROUTED:
        raise ValueError(f"vLLM's routed experts hold expert id {int(routed_experts.max())}: grpo's record keeps "
                         f"ids below {NOT_ROUTED} (one byte each)")
    out = np.full((tokens, len(moe_layers), routed_experts.shape[-1]), NOT_ROUTED, dtype=np.uint8)
    kept = routed_experts[:tokens, moe_layers]
    out[:len(kept)] = kept
    return torch.from_numpy(out)
