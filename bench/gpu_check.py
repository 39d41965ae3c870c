"""The GPU check: grpo's engine and trainer on one GPU, in one command, one JSON line per check on stdout.

    python bench/gpu_check.py                 # on a CUDA machine (estimated 6-9 minutes on one H100)
    python bench/gpu_check.py --only B2,C1    # a subset;  --quick: shorter training checks
    python bench/gpu_check.py --cpu           # tiny shapes on the CPU (CI runs this): tests the script itself

Each line is {"check": NAME, "status": "ok" | "fail" | "error" | "skipped", "seconds": ..., ...}: "fail" when the
check ran but a number is outside its pass criterion (`criteria` lists the ones that failed), "error" when it raised
(`error`, `trace`), "skipped" with `why` (CUDA-only parts on the CPU, TRL not installed). Every check catches its
own errors, so one failure hides nothing else. The checks (bench/README.md, "The GPU check", says how to read them):

A_env  versions, the GPU, which optional packages import
B1     packed against padded log-probs, fp32 and bf16, for sdpa, eager and flash_attention_2 (where importable)
B2     which attention kernels run (profiler names) and the peak memory, padded against packed, 24-layer 0.5B shape
B3     grpo's tiled LM head against plain autograd under bf16 autocast, backward inside autocast
B4     host syncs (torch.cuda.set_sync_debug_mode) per packed update pass and per rollout token
B5     fused AdamW at lr 1e-6: the fraction of weights one step changes, bf16 against fp32 weights
C1     the default job (tiny-arith, arithmetic) on the GPU: learning over N steps, s/step, phase times
C2     weights changed by 5 steps at lr 1e-6 with bf16 weights (C2b: fp32 weights under bf16 autocast)
C3     LoRA with checkpoints, then a resume, then `from_pretrained(final)`
D      grpo against TRL's GRPOTrainer on the same work (bench/run.py): tokens/s and peak GPU memory

The engine checks use a randomly initialised Qwen2 of Qwen2.5-0.5B's shape (nothing is downloaded); the training
checks the shipped grpo/assets/tiny-arith. Nothing here needs `datasets` (D needs TRL, which needs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `bench` and `grpo` importable from the checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


@dataclass
class Context:
    """What every check reads: the device, the size of the run, where its files go."""

    device: torch.device
    quick: bool
    out: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


RESULTS = sys.stdout  # the JSON lines; main() sends everything else printed in this process to stderr


def emit(record: dict) -> None:
    print(json.dumps(record, default=str), file=RESULTS, flush=True)


def criteria(checks: dict[str, bool]) -> dict:
    """{"status": "ok"} when every named criterion holds, else "fail" and the names of those that do not."""
    failed = [name for name, held in checks.items() if not held]
    return {"status": "fail", "criteria": failed} if failed else {"status": "ok"}


def run_check(name: str, fn, ctx: Context) -> dict:
    """Run one check; its record, with its status and seconds, whatever happened inside."""
    start = time.perf_counter()
    try:
        record = {"status": "ok", **fn(ctx)}
        if ctx.cuda:  # inside the try: an asynchronous CUDA error surfaces here, as this check's error
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - the check reports the error; the others still run
        record = {"status": "error", "error": f"{type(err).__name__}: {err}"[:600],
                  "trace": traceback.format_exc()[-1500:]}
    if ctx.cuda:
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a broken context is already this check's error
            pass
    return {"check": name, **record, "seconds": round(time.perf_counter() - start, 2)}


def skipped(why: str) -> dict:
    return {"status": "skipped", "why": why}


def reset_peak(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(ctx: Context) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if ctx.cuda else None


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def import_status(name: str) -> str:
    """"yes", or why `import name` fails here (absent, or present and broken: a version it needs, say)."""
    try:
        __import__(name)
    except Exception as err:  # noqa: BLE001 - any failure to import is the answer
        return f"no ({type(err).__name__}: {str(err)[:120]})"
    return "yes"


def qwen_like(ctx: Context, dtype: torch.dtype, attn: str = "sdpa", layers: int | None = None):
    """A random Qwen2 of Qwen2.5-0.5B's shape (vocabulary 151,936, hidden 896, 14 heads, 2 KV heads, tied head; 24
    layers unless `layers`), or tiny shapes on the CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if ctx.cuda:
        shape = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers or 24,
                     num_attention_heads=14, num_key_value_heads=2)
    else:
        shape = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=min(layers or 2, 2),
                     num_attention_heads=4, num_key_value_heads=2)
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation=attn)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def grpo_batch(ctx: Context, seed: int = 0):
    """A GRPO micro-batch: 2 prompts x 8 completions (CPU: 2 x 4), prompts left-padded, completions right-padded and
    ragged (100-512 tokens; CPU 2-20). Returns ids and attention mask (n, P+W) on the device, and W."""
    rows, group, (p_lo, p_hi), (c_lo, c_hi), vocab = ((16, 8, (140, 180), (100, 512), 151936) if ctx.cuda
                                                      else (8, 4, (6, 12), (2, 20), 512))
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return torch.randint(5, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)

    prompts = [draw(p_lo, p_hi) for _ in range(rows // group)]
    completions = [draw(c_lo, c_hi) for _ in range(rows)]
    P, W = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros((rows, P + W), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(completions):
        p = prompts[i // group]
        ids[i, P - len(p):P], mask[i, P - len(p):P] = p, 1
        ids[i, P:P + len(c)], mask[i, P:P + len(c)] = c, 1
    return ids.to(ctx.device), mask.to(ctx.device), W


def packed_rows(model, ids, mask, width):
    """The packing grpo picks for `model`, and the micro-batch in it (on the model's device)."""
    from grpo.engines.packing import choose_packing, pack

    packing, why = choose_packing(model)
    if packing is None:
        raise RuntimeError(f"no packing for this model: {why}")
    return pack(ids.cpu(), mask.cpu(), width, packing).to(ids.device)


# ---- A: the environment ----------------------------------------------------------------------------------------
def check_env(ctx: Context) -> dict:
    import accelerate
    import peft
    import transformers

    info = dict(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                accelerate=accelerate.__version__, peft=peft.__version__, python=sys.version.split()[0],
                device=str(ctx.device))
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    mem_gib=round(props.total_memory / 2**30, 1))
    info["imports"] = {name: import_status(name) for name in ("flash_attn", "datasets", "trl", "vllm", "deepspeed",
                                                              "rich", "math_verify")}
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return {**info, **criteria({"torch >= 2.11": major_minor >= (2, 11)})}


# ---- B: the engine on a 0.5B-shaped random model -----------------------------------------------------------------
def check_packed_numerics(ctx: Context) -> dict:
    """B1: packed against padded completion log-probs over the real tokens (max and mean absolute difference)."""
    from grpo.engines.policy import completion_logprobs

    ids, mask, width = grpo_batch(ctx)
    real = mask[:, -width:].bool()
    results, checks = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        for attn in ("sdpa", "eager", "flash_attention_2"):
            name = f"{attn}/{str(dtype)[6:]}"
            if attn.startswith("flash") and not (ctx.cuda and importable("flash_attn")):
                results.append({"attn": attn, "dtype": str(dtype), "status": "skipped",
                                "why": "flash_attn is not installed" if ctx.cuda else "CUDA only"})
                continue
            model = qwen_like(ctx, dtype, attn, layers=4)
            with torch.no_grad():
                padded = completion_logprobs(model, ids, mask, width, 1.0)
                rows = packed_rows(model, ids, mask, width)
                packed = completion_logprobs(model, ids, mask, width, 1.0, packed=rows)
            diff = (packed.float() - padded.float()).abs()[real]
            entry = dict(attn=attn, dtype=str(dtype), packing=rows.packing.describe(),
                         max_abs=float(diff.max()), mean_abs=float(diff.mean()), rows=list(rows.input_ids.shape),
                         tokens_packed=rows.tokens, tokens_padded=int(ids[:, :-1].numel()))
            results.append(entry)
            if dtype == torch.float32:
                checks[f"{name} max <= 1e-4"] = entry["max_abs"] <= 1e-4
            else:
                checks[f"{name} mean <= 1e-2 and max <= 0.1"] = entry["mean_abs"] <= 1e-2 and entry["max_abs"] <= 0.1
            checks[f"{name} packs fewer tokens"] = entry["tokens_packed"] < entry["tokens_padded"]
            del model
    return {"results": results, **criteria(checks)}


def forward_backward(model, ids, mask, width, rows):
    from grpo.engines.policy import completion_logprobs

    logp = completion_logprobs(model, ids, mask, width, 1.0, packed=rows)
    (logp * mask[:, -width:]).sum().backward()
    model.zero_grad(set_to_none=True)


def attention_kernels(ctx: Context, run) -> list[str]:
    """Names of the attention, softmax and batched-product kernels and operators one call of `run` launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities) as prof:
        run()
        if ctx.cuda:
            torch.cuda.synchronize()
    keys = ("fmha", "flash", "efficient", "cudnn", "attention", "softmax", "bmm")
    return sorted({e.key for e in prof.key_averages() if any(k in e.key.lower() for k in keys)})[:30]


def check_kernels_and_memory(ctx: Context) -> dict:
    """B2: a bf16 forward+backward of the micro-batch, padded then packed (sdpa): seconds and peak memory of each,
    the attention kernels of the packed pass, and (CUDA) whether it runs with one SDPA backend allowed at a time."""
    model = qwen_like(ctx, torch.bfloat16, "sdpa").train()
    ids, mask, width = grpo_batch(ctx)
    rows = packed_rows(model, ids, mask, width)
    passes = {}
    for label, layout in (("padded", None), ("packed", rows)):
        forward_backward(model, ids, mask, width, layout)  # (warm-up: kernel selection, allocator)
        reset_peak(ctx)
        start = time.perf_counter()
        forward_backward(model, ids, mask, width, layout)
        if ctx.cuda:
            torch.cuda.synchronize()
        passes[label] = dict(seconds=round(time.perf_counter() - start, 4), peak_gib=peak_gib(ctx))
    mask_4d = rows.attention_mask(torch.bfloat16)
    out = dict(layers=model.config.num_hidden_layers, rows=list(rows.input_ids.shape), **passes,
               mask_shape=None if mask_4d is None else list(mask_4d.shape),
               mask_mib=None if mask_4d is None else round(mask_4d.numel() * mask_4d.element_size() / 2**20, 2),
               kernels=attention_kernels(ctx, lambda: forward_backward(model, ids, mask, width, rows)))
    if not ctx.cuda:
        return {**out, "backends": "CUDA only"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {}
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                forward_backward(model, ids, mask, width, rows)
            backends[backend.name] = "ran"
        except Exception as err:  # noqa: BLE001 - FLASH takes no mask: expected to refuse
            backends[backend.name] = f"refused: {str(err)[:160]}"
    fused = any(k in name.lower() for name in out["kernels"] for k in ("fmha", "efficient", "cudnn", "flash"))
    return {**out, "backends": backends, **criteria({
        "packed peak <= padded peak": passes["packed"]["peak_gib"] <= passes["padded"]["peak_gib"],
        "packed time <= padded time": passes["packed"]["seconds"] <= passes["padded"]["seconds"],
        "a fused attention kernel ran": fused,
        "EFFICIENT_ATTENTION alone runs": backends["EFFICIENT_ATTENTION"] == "ran"})}


def check_head_under_autocast(ctx: Context) -> dict:
    """B3: grpo's tiled head (`hidden_logprobs`) against plain autograd, fp32 weights under bf16 autocast and pure
    bf16 weights, backward inside autocast as the trainer calls it: log-prob difference, relative gradient errors."""
    from grpo.core import hidden_logprobs

    V, H, N = (151936, 896, 2048) if ctx.cuda else (512, 32, 64)
    results, checks = [], {}
    for wdtype, autocast in ((torch.float32, True), (torch.bfloat16, False)):
        torch.manual_seed(0)
        w0 = (torch.randn(V, H, device=ctx.device) * 0.02).to(wdtype)
        h0 = torch.randn(1, N, H, device=ctx.device).to(wdtype)
        y = torch.randint(0, V, (1, N), device=ctx.device)
        g = torch.randn(1, N, device=ctx.device)
        got = {}
        for name in ("grpo", "plain"):
            w, h = w0.clone().requires_grad_(), h0.clone().requires_grad_()
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
                if name == "grpo":
                    logp, _ = hidden_logprobs(h, w, y)
                else:
                    logits = torch.nn.functional.linear(h, w).float()
                    logp = logits.log_softmax(-1).gather(-1, y[..., None])[..., 0]
                (logp * g).sum().backward()
            got[name] = (logp.detach().float(), h.grad.float(), w.grad.float())

        def rel(i):
            return float((got["grpo"][i] - got["plain"][i]).norm() / got["plain"][i].norm().clamp(min=1e-30))

        entry = dict(weights=str(wdtype), autocast=autocast, grad_hidden_rel=rel(1), grad_weight_rel=rel(2),
                     logp_max_abs=float((got["grpo"][0] - got["plain"][0]).abs().max()))
        results.append(entry)
        label = f"{str(wdtype)[6:]}{' autocast' if autocast else ''}"
        checks[f"{label} logp <= 1e-3"] = entry["logp_max_abs"] <= 1e-3
        checks[f"{label} grads <= 1e-2 relative"] = max(entry["grad_hidden_rel"], entry["grad_weight_rel"]) <= 1e-2
    return {"results": results, **criteria(checks)}


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


def check_bf16_adamw(ctx: Context) -> dict:
    """B5: one AdamW step as grpo's make_optimizer builds it (fused, lr 1e-6) on a std-0.02 weight: the fraction of
    elements it changes, bf16 against fp32 weights (D1: about 0.02 against 1.0)."""
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        weight = torch.nn.Parameter((torch.randn(2048, 2048, device=ctx.device) * 0.02).to(dtype))
        before = weight.detach().clone()
        opt = torch.optim.AdamW([weight], lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
        weight.grad = torch.randn_like(weight) * 1e-3
        opt.step()
        results[str(dtype)] = round(float((weight.detach() != before).float().mean()), 4)
    return {"frac_changed": results, **criteria({"fp32 weights all change": results["torch.float32"] > 0.99})}


CHECKS = {"A_env": check_env, "B1": check_packed_numerics, "B2": check_kernels_and_memory,
          "B3": check_head_under_autocast, "B4": check_host_syncs, "B5": check_bf16_adamw}


def all_checks() -> dict:
    from bench.gpu_check_train import TRAINING_CHECKS

    return {**CHECKS, **TRAINING_CHECKS}


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (tests the script itself)")
    parser.add_argument("--quick", action="store_true", help="shorter training checks (C1 40 steps, D 2 steps)")
    parser.add_argument("--only", default="", help="comma-separated checks, e.g. B2,C1 (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="the training checks' run directories (default: a "
                                                               "temporary directory, deleted)")
    args = parser.parse_args(argv)
    names = list(all_checks())
    args.only = [n.strip() for n in args.only.split(",") if n.strip()] or names
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; choose from {', '.join(names)}.")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the chosen checks, printing each one's line as it ends; exit status 1 when any failed or raised."""
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    checks = all_checks()
    bad = 0
    with tempfile.TemporaryDirectory(prefix="grpo-gpu-check-") as tmp:
        ctx = Context(device, args.quick, args.out or Path(tmp))
        for name in args.only:
            record = run_check(name, checks[name], ctx)
            emit(record)
            bad += record["status"] in ("fail", "error")
    return 1 if bad else 0


if __name__ == "__main__":
    # The JSON lines are the only thing on stdout: what the trainer and the libraries print goes to stderr.
    RESULTS = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.exit(main())
