"""The GPU check's engine checks (bench/gpu_check.py runs them) beside those in gpu_check.py: host syncs (B4), and
for the code that came after the first GPU review, activation offload (B6), the float32 LM head (B7) and the lag
pipeline's host copy of the weights (B8), on a
randomly initialised model of Qwen2.5-0.5B's shape (B6, B7: float32 weights under bf16 autocast, the GPU recipe's
precision; tiny shapes on the CPU). Each returns its JSON
record's fields; bench/gpu_check.py adds the check's name, status and seconds."""

from __future__ import annotations

import os
import time
import warnings

import torch

from bench.gpu_check import (Context, criteria, forward_backward, grpo_batch, importable, packed_rows, peak_gib,
                             qwen_like, reset_peak, skipped)


def count_syncs(run) -> dict:
    """Synchronising calls during `run()` (torch.cuda.set_sync_debug_mode("warn")), with the top call sites."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{os.path.basename(w.filename)}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    top = dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8])
    return {"total": sum(sites.values()), "sites": top}


def check_host_syncs(ctx: Context) -> dict:
    """B4: host syncs in one packed update pass (forward + backward) and in a 32-token rollout of 16 rows."""
    if not ctx.cuda:
        return skipped("CUDA only: torch.cuda.set_sync_debug_mode counts device-to-host synchronisations")
    from grpo.engines.base import SamplingParams
    from grpo.engines.sampling import TransformersSampler

    tokens, results, checks = 32, [], {}
    for attn in ("sdpa", "flash_attention_2"):
        if attn.startswith("flash") and not importable("flash_attn"):
            results.append({"attn": attn, "status": "skipped", "why": "flash_attn is not installed"})
            continue
        model = qwen_like(ctx, torch.bfloat16, attn).train()
        ids, mask, width = grpo_batch(ctx)
        rows = packed_rows(model, ids, mask, width)
        prompts = [row[m.bool()].tolist()[-100:] for row, m in zip(ids[:, :-width].cpu(), mask[:, :-width].cpu())]
        sampler = TransformersSampler(model, 0, [])
        update = count_syncs(lambda: forward_backward(model, ids, mask, width, rows))
        rollout = count_syncs(lambda: sampler.generate(prompts, SamplingParams(tokens), list(range(len(prompts)))))
        results.append(dict(attn=attn, layers=model.config.num_hidden_layers, update_pass=update,
                            rollout=rollout, rollout_per_token=round(rollout["total"] / tokens, 2)))
        checks[f"{attn} update pass <= 5 syncs"] = update["total"] <= 5
        del model, sampler
    return {"results": results, **criteria(checks)}


class Autocast:
    """The part of accelerate's Accelerator a backend uses: one process, bf16 autocast on the context's device."""

    num_processes = 1

    def __init__(self, device: torch.device):
        self.device = device

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


def long_rows(ctx: Context, lengths: list[int], prompt: int = 64, seed: int = 0):
    """(ids, mask, width) on the device: `len(lengths)` rows sharing one prompt of `prompt` tokens, completions of
    `lengths` tokens right-padded."""
    vocab = qwen_like_vocab(ctx)
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), prompt + width), generator=g)
    ids[:, :prompt] = ids[0, :prompt]
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, :prompt + n] = 1
    return (ids * mask).to(ctx.device), mask.to(ctx.device), width


def qwen_like_vocab(ctx: Context) -> int:
    return 151936 if ctx.cuda else 512


def relative(a: dict, b: dict) -> float:
    """The largest relative difference (Frobenius norms) over the tensors of two name -> tensor dicts."""
    return max(float((a[n] - b[n]).float().norm() / b[n].float().norm().clamp(min=1e-30)) for n in b)


def check_activation_offload(ctx: Context) -> dict:
    """B6: one update pass (forward + backward, grpo's TransformersBackend) of a long packed micro-batch (2 rows of
    ~2k tokens on a GPU, 24 layers) with and without `activation_offloading`, without and with gradient
    checkpointing (set as the trainer sets it): peak memory, seconds (the second of two passes) and what the hooks
    moved; the gradients with offload against without. On the CPU every tensor is in host memory already: the hooks
    see the saved tensors and move nothing, and only the gradients and the hooks' counts are checked."""
    from grpo import GRPOConfig
    from grpo.core import LossOutput
    from grpo.engines.policy import MicroBatch, TransformersBackend
    from grpo.training.setup.model import prepare_model

    model = qwen_like(ctx, torch.float32, "sdpa").train()
    model.requires_grad_(True)
    ids, mask, width = long_rows(ctx, [2048, 1900] if ctx.cuda else [96, 80])
    micro = MicroBatch(ids, mask, width, packed=packed_rows(model, ids, mask, width))
    real = mask[:, -width:].float()
    advantages = torch.tensor([1.0, -0.5], device=ctx.device)[:, None]

    def loss_fn(logp, rows, entropy):  # a loss whose gradient reaches every completion position
        return LossOutput(-(advantages * logp * real).sum() / real.sum())

    results, checks = {}, {}
    for checkpointing in (False, True):
        if checkpointing:
            prepare_model(model, GRPOConfig(gradient_checkpointing=True, beta=0.0))
        grads = {}
        for offload in (False, True):
            backend = TransformersBackend(model, Autocast(ctx.device), offload=offload)
            for _ in range(2):  # (the first pass: kernel choice, the allocators' growth)
                model.zero_grad(set_to_none=True)
                reset_peak(ctx)
                start = time.perf_counter()
                backend.loss_and_backward(micro, 1.0, loss_fn, False)
                if ctx.cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            grads[offload] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            stats = backend.offloaded
            label = f"{'checkpointing' if checkpointing else 'plain'}{' + offload' if offload else ''}"
            results[label] = dict(seconds=round(seconds, 4), peak_gib=peak_gib(ctx),
                                  offload=None if stats is None else dict(
                                      saved=stats.saved, saved_mib=round(stats.saved_bytes / 2**20, 1),
                                      moved_mib=round(stats.moved_bytes / 2**20, 1),
                                      on_host_mib=round(stats.on_host_bytes / 2**20, 1)))
        model.zero_grad(set_to_none=True)
        mode = "checkpointing" if checkpointing else "plain"
        results[f"{mode}: gradient_rel_diff"] = relative(grads[True], grads[False])
        del grads
        # A wrong tensor restored in backward gives O(1); float32 reductions in another order ~1e-6.
        checks[f"{mode}: gradients with offload within 1e-3 of without"] = (
            results[f"{mode}: gradient_rel_diff"] <= 1e-3)
        stats = results[f"{mode} + offload"]["offload"]
        checks[f"{mode}: the hooks saw the pass"] = stats["saved"] > 0
        if ctx.cuda:
            checks[f"{mode}: activations moved to host"] = stats["moved_mib"] > 0
            checks[f"{mode}: lower peak with offload"] = (results[f"{mode} + offload"]["peak_gib"]
                                                          < results[mode]["peak_gib"])
    return {"tokens": int(mask.sum()), "layers": model.config.num_hidden_layers, "passes": results,
            **criteria(checks)}


def check_float32_head(ctx: Context) -> dict:
    """B7: `cast_lm_head_to_fp32` under bf16 autocast (fp32 weights): the update pass's completion log-probs
    (grpo's tiled head) against float64 arithmetic on the same final hidden states, with and without the cast. With
    it the head's products are float32 (autocast off, TF32 as torch's default: off), within 1e-4 of float64; without
    it they are bf16's, ~1e-3 off (logits of size ~0.6 at 2^-9 relative), so the cast must also bring the gap down
    by 10x or more, or it did not take effect."""
    from grpo.engines.policy import completion_logprobs
    from grpo.training.setup.model import cast_lm_head_to_fp32

    ids, mask, width = long_rows(ctx, [200, 150, 120, 90] if ctx.cuda else [20, 12])
    real = mask[:, -width:].bool()
    targets = ids[:, -width:]
    results, checks = {}, {}
    for cast in (False, True):
        model = qwen_like(ctx, torch.float32, "sdpa", layers=4).train()
        if cast:
            cast_lm_head_to_fp32(model)
        seen = {}
        hook = model.model.norm.register_forward_hook(lambda module, args, out: seen.__setitem__("h", out.detach()))
        with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            logp = completion_logprobs(model, ids, mask, width, 1.0).detach()  # (the update's pass: no shared prompt)
        hook.remove()
        start = ids.shape[1] - width - 1  # (position j predicts token j + 1; the last position may not be run)
        hidden = seen["h"][:, start:start + width]
        weight = model.get_output_embeddings().weight.detach().double()
        exact = torch.empty_like(logp, dtype=torch.float64)
        for r in range(hidden.shape[0]):
            for s in range(0, width, 256):  # (a row's positions in chunks: float64 logits of 151,936 columns)
                logits = hidden[r, s:s + 256].double() @ weight.T
                exact[r, s:s + 256] = logits.log_softmax(-1).gather(-1, targets[r, s:s + 256, None])[:, 0]
        gap = (logp.double() - exact).abs()[real]
        name = "float32 head" if cast else "bf16 head"
        results[name] = dict(max_abs=float(gap.max()), mean_abs=float(gap.mean()),
                             head_weight=str(model.get_output_embeddings().weight.dtype))
        del model
    checks["float32 head within 1e-4 of float64"] = results["float32 head"]["max_abs"] <= 1e-4
    checks["the cast brings the gap down 10x"] = (results["bf16 head"]["mean_abs"]
                                                  >= 10 * results["float32 head"]["mean_abs"])
    return {"tokens": int(real.sum()), "results": results, **criteria(checks)}


def check_host_copy(ctx: Context) -> dict:
    """B8: the lag pipeline's host copy of the weights (grpo.engines.vllm_weights.HostCopy, which the push thread
    sends while the next update runs): float32 weights of Qwen2.5-0.5B's shape copied off the device into bf16 host
    buffers, pinned on a GPU, with one wait for all of them (no synchronising copy per tensor), the buffers reused by
    the next copy, and the values those of the weights cast to bf16."""
    from grpo.engines.sharding import hf_weights
    from grpo.engines.vllm_weights import HostCopy

    model = qwen_like(ctx, torch.float32, "sdpa")
    host, seconds = HostCopy(), []
    first = dict(host.take(hf_weights(model), torch.bfloat16))
    if ctx.cuda:
        syncs = count_syncs(lambda: host.take(hf_weights(model), torch.bfloat16))
    t0 = time.perf_counter()
    second = dict(host.take(hf_weights(model), torch.bfloat16))
    seconds.append(time.perf_counter() - t0)
    weights = dict(hf_weights(model))
    nbytes = sum(t.numel() * t.element_size() for t in second.values())
    checks = {"the values are the weights in bf16": all(torch.equal(second[n], w.detach().to(torch.bfloat16).cpu())
                                                         for n, w in weights.items()),
              "the next copy reuses the buffers": all(second[n].data_ptr() == first[n].data_ptr() for n in first)}
    result = {"tensors": len(second), "mib": round(nbytes / 2**20, 1), "copy_s": round(seconds[0], 4),
              "gib_per_s": round(nbytes / 2**30 / seconds[0], 2)}
    if ctx.cuda:
        checks["pinned host buffers"] = all(t.is_pinned() for t in second.values())
        checks["at most one synchronisation a copy"] = syncs["total"] <= 1
        result["syncs"] = syncs
    del model
    return {**result, **criteria(checks)}


ENGINE_CHECKS = {"B4": check_host_syncs, "B6": check_activation_offload, "B7": check_float32_head,
                 "B8": check_host_copy}
