"""The GPU check: grpo's engine and trainer on one GPU, in one command, one JSON line per check on stdout.

    python bench/gpu_check.py                 # on a CUDA machine (about 7 minutes on one H200, estimated)
    python bench/gpu_check.py --only B6,E1    # a subset, in that order;  --quick: shorter training checks
    python bench/gpu_check.py --budget 300    # skip (with the reason) a check whose estimate no longer fits
    python bench/gpu_check.py --cpu           # tiny shapes on the CPU (CI runs this): tests the script itself

Each line is {"check": NAME, "status": "ok" | "fail" | "error" | "skipped", "seconds": ..., ...}: "fail" when the
check ran but a number is outside its pass criterion (`criteria` lists the ones that failed), "error" when it raised
(`error`, `trace`), "skipped" with `why` (CUDA-only parts on the CPU, a package not installed, the budget). Every
check catches its own errors, its CUDA work synchronised inside; after an error that leaves the CUDA context unusable
(a device-side assert) the remaining checks run in a fresh process. The last line, {"check": "untested", "status":
"info"}, names what no check here exercised and why (vLLM, several GPUs, flash-attn, skipped checks). The checks
(bench/README.md, "The GPU check", says how to read them):

A_env  versions, the GPU, which optional packages import
B1     packed against padded log-probs, fp32 and bf16, for sdpa, eager and flash_attention_2 (where importable)
B2     which attention kernels run (profiler names) and the peak memory, padded against packed, 24-layer 0.5B shape
B3     grpo's tiled LM head against plain autograd under bf16 autocast, backward inside autocast
B4     host syncs (torch.cuda.set_sync_debug_mode) per packed update pass and per rollout token
B5     grpo's optimizer (make_optimizer) at lr 1e-6: fused, the weights one step changes, bf16 against fp32, and
       the low-precision warning's estimate against what the step did
B6     activation offload on a long micro-batch: peak memory and time with and without, gradients equal
B7     cast_lm_head_to_fp32 under bf16 autocast: the head's log-probs against float64
C1     the default job (tiny-arith, arithmetic): learning over N steps, s/step, phase times, and the sampler's
       log-probs against the update's on the same tokens (engine/trainer mismatch)
C2     weights changed by 5 steps at lr 1e-6 with bf16 weights, and the trainer's warning (C2b: fp32 + autocast)
C3     LoRA with checkpoints, then a resume, then `from_pretrained(final)`
C4     full_determinism: two runs of the default job, in a fresh process, give the same weights
C5     the tiny VLM (grpo/assets/tiny-vision, the shapes task) end to end
E1     grpo alone at the GPU recipe's settings (recipes/gpu/qwen2.5-0.5b-gsm8k.yaml) on a random 0.5B: generation and
       update tokens/s, the trainer's memory/peak_gib (needs neither TRL nor datasets)
D      grpo against TRL's GRPOTrainer on the same work (bench/run.py): tokens/s and peak GPU memory

The engine checks use a randomly initialised Qwen2 of Qwen2.5-0.5B's shape (nothing is downloaded); the training
checks the shipped grpo/assets models. Nothing here needs `datasets` (D needs TRL, which needs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
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
                                                              "rich", "math_verify", "PIL", "torchvision")}
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
    from grpo.engines.head import hidden_logprobs

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


def check_optimizer(ctx: Context) -> dict:
    """B5: grpo's optimizer (`make_optimizer`, as the trainer builds it) at lr 1e-6 on a std-0.02 weight: whether it
    took the fused implementation, the fraction of elements one step changes (bf16 against fp32 weights, D1: about
    0.02 against 1.0), and the trainer's low-precision warning and its estimate of the unchanged share
    (`rounded_away`), which must match what the step did: AdamW's first step moves each element by lr (m/sqrt(v) =
    g/|g|), so an element stays exactly where w +- lr rounds back to w."""
    from grpo import GRPOConfig
    from grpo.training.setup.optimizer import make_optimizer, rounded_away, warn_low_precision_training

    n = 2048 if ctx.cuda else 512
    cfg = GRPOConfig(learning_rate=1e-6)
    results, checks = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        model = torch.nn.Linear(n, n, bias=False, device=ctx.device)
        with torch.no_grad():
            model.weight.normal_(0.0, 0.02)
        model.to(dtype)
        optimizer = make_optimizer(model, cfg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_low_precision_training(model, optimizer, cfg, "NO", "no")
        estimate = rounded_away(list(model.parameters()), cfg.learning_rate)
        before = model.weight.detach().clone()
        model.weight.grad = torch.randn_like(model.weight) * 1e-3
        optimizer.step()
        changed = float((model.weight.detach() != before).float().mean())
        name = str(dtype).removeprefix("torch.")
        results[name] = dict(frac_changed=round(changed, 4), rounded_away_estimate=round(estimate, 4),
                             fused=optimizer.defaults.get("fused"),
                             warned=any("rounded away" in str(w.message) for w in caught))
        checks[f"{name}: fused AdamW"] = results[name]["fused"] is True
        # (the estimate reads 2^16 elements: a binomial standard error of 6e-4 at p = 0.02)
        checks[f"{name}: unchanged share within 0.01 of the warning's estimate"] = abs(1 - changed - estimate) <= 0.01
    checks["bfloat16: the trainer warns"] = results["bfloat16"]["warned"]
    checks["float32: no warning, every weight moves"] = (not results["float32"]["warned"]
                                                         and results["float32"]["frac_changed"] > 0.99)
    return {"optimizer": results, **criteria(checks)}


CHECKS = {"A_env": check_env, "B1": check_packed_numerics, "B2": check_kernels_and_memory,
          "B3": check_head_under_autocast, "B5": check_optimizer}

# Seconds each check takes on one H200 (measured 2026-11-28 where known, else estimated from its work), and with
# --quick; --budget skips a check whose estimate no longer fits. CPU runs (--cpu) are not budgeted.
ESTIMATE_S = {"A_env": (15, 15), "B1": (5, 5), "B2": (8, 8), "B3": (1, 1), "B4": (5, 5), "B5": (1, 1),
              "B6": (15, 15), "B7": (5, 5), "B8": (5, 5), "C1": (105, 45), "C2": (15, 12), "C2b": (7, 5), "C3": (18, 18),
              "C4": (25, 25), "C5": (12, 12), "E1": (60, 60), "D": (140, 140)}


def all_checks() -> dict:
    from bench.gpu_check_engine import ENGINE_CHECKS
    from bench.gpu_check_throughput import THROUGHPUT_CHECKS
    from bench.gpu_check_train import TRAINING_CHECKS

    checks = {**CHECKS, **ENGINE_CHECKS, **TRAINING_CHECKS, **THROUGHPUT_CHECKS}
    return {name: checks[name] for name in ESTIMATE_S}  # (the order of a full run: D, the longest, last)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (tests the script itself)")
    parser.add_argument("--quick", action="store_true", help="shorter training checks (C1 40 steps, C2 and C2b 3)")
    parser.add_argument("--only", default="", help="comma-separated checks, run in that order, e.g. B6,E1 "
                                                   "(default: all)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="skip a check when the run's seconds so far plus its estimate (ESTIMATE_S) exceed this")
    parser.add_argument("--out", type=Path, default=None, help="the training checks' run directories (default: a "
                                                               "temporary directory, deleted)")
    args = parser.parse_args(argv)
    names = list(ESTIMATE_S)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()] or names
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; choose from {', '.join(names)}.")
    return args


def over_budget(name: str, args, spent: float, cuda: bool) -> str | None:
    """Why `name` is skipped under --budget (its estimate does not fit in what is left), or None."""
    if args.budget is None or not cuda:
        return None
    estimate = ESTIMATE_S[name][1 if args.quick else 0]
    left = args.budget - spent
    return (f"--budget {args.budget:g} s: about {estimate} s estimated, {max(left, 0):.0f} s left"
            if estimate > left else None)


def context_broken(ctx: Context) -> str | None:
    """Why the CUDA context can no longer run work (a sticky error such as a device-side assert), or None."""
    if not ctx.cuda:
        return None
    try:
        torch.ones(1, device=ctx.device).add_(1)
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - any failure here means the context is gone
        return f"{type(err).__name__}: {str(err)[:200]}"
    return None


def continue_in_fresh_process(names: list[str], args, spent: float) -> int:
    """Run the checks `names` in a new process of this script (a fresh CUDA context), its lines on RESULTS."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--only", ",".join(names)]
    cmd += ["--quick"] * args.quick + ["--cpu"] * args.cpu + (["--out", str(args.out)] if args.out else [])
    if args.budget is not None:
        cmd += ["--budget", str(max(args.budget - spent, 0.0))]
    RESULTS.flush()
    return subprocess.run(cmd, cwd=ROOT, stdout=RESULTS, check=False).returncode


def untested(ctx: Context, records: list[dict]) -> dict:
    """The last line: the paths no check of this run exercised, and why."""
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    several = (f"need two or more GPUs ({gpus} here)" if gpus < 2
               else "need several processes; every check here runs in one")
    vllm = import_status("vllm")
    paths = {
        "vLLM (colocate and server mode, the NCCL/gloo weight push, sleep mode)":
            f"vllm does not import: {vllm}" if vllm != "yes" else "no check here runs vLLM (bench/run.py --sides "
                                                                   "vllm does)",
        "DDP, FSDP2, DeepSpeed ZeRO-2/3, a DDP resume, sequence parallelism (Ulysses), the NCCL weight push": several,
        "flash_attention_2": ("flash_attn does not import: " + import_status("flash_attn")
                              if import_status("flash_attn") != "yes" else "run by B1 and B4"),
    }
    if not ctx.cuda:
        paths["everything on CUDA"] = "--cpu: tiny shapes on the CPU, which test the script, not the GPU"
    skipped_checks = {r["check"]: r["why"] for r in records if r["status"] == "skipped"}
    return {"check": "untested", "status": "info", "paths": paths, "skipped_checks": skipped_checks}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen checks, printing each one's line as it ends, then the untested paths; exit status 1 when any
    check failed or raised."""
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    checks, records, started = all_checks(), [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo-gpu-check-") as tmp:
        ctx = Context(device, args.quick, args.out or Path(tmp))
        for i, name in enumerate(args.only):
            why = over_budget(name, args, time.perf_counter() - started, ctx.cuda)
            record = {"check": name, **skipped(why), "seconds": 0.0} if why else run_check(name, checks[name], ctx)
            emit(record)
            records.append(record)
            broken = context_broken(ctx) if record["status"] == "error" else None
            if broken and args.only[i + 1:]:
                emit({"check": "restart", "status": "info", "why": f"the CUDA context is unusable after {name} "
                      f"({broken}): the remaining checks run in a fresh process"})
                continue_in_fresh_process(args.only[i + 1:], args, time.perf_counter() - started)
                return 1  # (a check of this process raised; the fresh one printed the rest, untested paths too)
        emit(untested(ctx, records))
    return 1 if any(r["status"] in ("fail", "error") for r in records) else 0


if __name__ == "__main__":
    # The JSON lines are the only thing on stdout: what the trainer and the libraries print goes to stderr.
    RESULTS = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.exit(main())
