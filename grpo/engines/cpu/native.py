"""The compiled decode step and sampling LM head (csrc/lean_step.c), softmax passes (csrc/softmax.c) and
training's fused layer operators (csrc/layer_ops.c): built on first use with the system C compiler, loaded with
ctypes, and wrapped as `CompiledStep` (used by `decoding.LeanDecoder.compiled`), `CompiledHead` (used by
`decoding.packed_head`), `sample` (used by `generation.sample_rows`), `TileKernels` (used by grpo.core's tiled LM
head) and grpo/engines/cpu/fused.py's autograd functions.

`library()` returns the loaded library, or None when there is no C compiler, the build fails, or GRPO_NATIVE=0
is set; callers then keep the torch step. The shared object is cached per source, compiler flags and CPU under
$GRPO_CACHE_DIR (default ~/.cache/grpo/native), written under a temporary name and renamed, so concurrent
processes never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from grpo.engines.cpu.layers import layer_products, stacked_bias

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "lean_step.c", CSRC / "softmax.c", CSRC / "layer_ops.c"]
HEADERS = [CSRC / "vecmath.h"]
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared"]


class Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down", "down_bias",
        "keys", "values")]


class Model(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int32) for name in (
        "rows", "hidden", "q_heads", "kv_heads", "head_dim", "inter", "capacity", "layers")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("embed", "final_norm", "cos", "sin")],
        ("layer", ctypes.POINTER(Layer)), ("scratch", ctypes.c_void_p)]


def _cpu_tag() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(lines)


def _cache_dir() -> Path:
    """$GRPO_CACHE_DIR/native (default ~/.cache/grpo/native), or a per-user folder in the temporary directory when
    that cannot be created (a read-only or missing home)."""
    try:
        folder = Path(os.environ.get("GRPO_CACHE_DIR") or Path.home() / ".cache" / "grpo") / "native"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except (OSError, RuntimeError):
        pass
    # A shared temporary directory: the folder must be this user's alone, or another user could plant a library.
    folder = Path(tempfile.gettempdir()) / f"grpo-native-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.stat()
    if (hasattr(os, "getuid") and info.st_uid != os.getuid()) or info.st_mode & 0o077:
        raise OSError(f"{folder} is not private to this user; set GRPO_CACHE_DIR")
    return folder


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _build(compiler: list[str], target: Path, flags: list[str] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        result = subprocess.run([*compiler, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                                text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=1)
def library():
    """The compiled step's library, or None (no compiler, a failed build, or GRPO_NATIVE=0): callers fall back."""
    if os.environ.get("GRPO_NATIVE", "1") == "0":
        return None
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found:
        log.info("grpo.engines.cpu.native: no C compiler found; sampling uses the torch step")
        return None
    compiler = shlex.split(found)  # CC may carry a launcher or flags, e.g. "ccache gcc"
    try:
        texts = [f.read_text() for f in SOURCES + HEADERS]
        key = hashlib.sha256("\n".join([*texts, *compiler, *FLAGS, _cpu_tag()]).encode()).hexdigest()
        target = _cache_dir() / f"lean_step-{key[:16]}.so"
        if not target.exists():
            try:
                _build(compiler, target)
            except RuntimeError:  # a compiler without -march=native (some clang and non-x86 gcc builds)
                _build(compiler, target, [f for f in FLAGS if f != "-march=native"])
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("grpo.engines.cpu.native: could not build the compiled decode step (%s); sampling uses the "
                    "torch step", err)
        return None
    return _declare(lib)


_MALLOC_MMAP_THRESHOLD, _MALLOC_TRIM_THRESHOLD = -3, -1  # glibc's mallopt parameters (malloc.h)
_KEEP_BELOW_BYTES, _KEEP_FREE_BYTES = 32 * 2**20, 128 * 2**20


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks under 32 MiB from its heap and keep up to 128 MiB of freed heap for reuse,
    instead of mapping each large block fresh and returning it when freed (its default adapts towards that, but
    trims the heap whenever its top is free). A training step frees and reallocates the same activations every
    micro-batch; on fresh memory each 4 KiB page costs a fault on first touch: the benchmark's W1 update took 12-20k
    faults (50-80 MB) and 0.43-0.45 s per step without this, none and 0.33-0.40 s with it, for ~20 MB more peak
    memory (three steps each, back to back). Larger blocks (a 151k vocabulary's 155 MB head gradient) are still
    mapped and returned. Process-wide; True where applied (glibc on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_MALLOC_MMAP_THRESHOLD, _KEEP_BELOW_BYTES) and mallopt(_MALLOC_TRIM_THRESHOLD, _KEEP_FREE_BYTES))


_I32, _I64, _PTR, _F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {  # name: (argument types, result type), as in lean_step.c and softmax.c
    "lean_step": ([ctypes.POINTER(Model), _PTR, _PTR, _I32, _PTR, _I64, _PTR], None),
    "lean_scratch_floats": ([_I32] * 6, _I64),
    "lean_packed_floats": ([_I32, _I32], _I64),
    "lean_pack_rows": ([_I32, _I32, _I32, _I32, _PTR, _PTR], None),
    "lean_head_packed_floats": ([_I32, _I32], _I64),
    "lean_pack_head": ([_I32, _I32, _PTR, _PTR], None),
    "lean_head": ([_I32, _I32, _I32, _PTR, _PTR, _PTR, _PTR], None),
    "lean_wide_vectors": ([], _I32),
    "lean_sample_scratch_floats": ([_I32], _I64),
    "lean_sample": ([_I32, _I32, _PTR, _PTR, _PTR, _PTR, _PTR], _I32),
    "lean_tile_stats": ([_I32, _I32, _I64, _PTR, _F32, _PTR, _I64, _PTR, _PTR, _PTR, _PTR], None),
    "lean_tile_shifted_exp": ([_I32, _I32, _I64, _PTR, _PTR, _F32, _PTR, _PTR, _PTR], None),
    "lean_tile_grad": ([_I32, _I32, _I64, _PTR, _F32, _PTR, _PTR, _PTR, _PTR], None),
    "lean_tile_exp": ([_I32, _I32, _I64, _PTR, _PTR, _PTR, _PTR], None),
    "lean_swiglu": ([_I64, _PTR, _PTR, _PTR], None),
    "lean_swiglu_grad": ([_I64, _PTR, _PTR, _PTR, _PTR, _PTR], None),
    "lean_rms_norm": ([_I64, _I32, _PTR, _PTR, _F32, _PTR, _PTR], None),
    "lean_rms_norm_grad": ([_I64, _I32, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR], None),
}


def _declare(lib):
    """Set the argument and result types of the library's functions (ctypes would guess ints otherwise)."""
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


_ANY_THREADS_BYTES = 32 * 2**20
"""Decoder layers up to this size (bytes) take the single-threaded C step whatever torch's thread count: per-operator
overhead, not arithmetic, bounds the torch step there (the benchmark's W1, 17 MB: 2.0 ms per token against 3.1 ms
for torch on 2 threads). Larger layers take it only when torch runs one thread."""


_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary variants whose frequencies do not depend on the sequence length, so one table of cos/sin per rollout
equals the per-step computation (dynamic NTK and longrope rescale with the longest position seen)."""


class CompiledStep:
    """`decoding.LeanDecoder.hidden` as one C call per token: the ~60 small torch operators of a layer cost ~3 ms
    per token on W1 of the benchmark, mostly dispatch; the compiled step runs at the speed of streaming the
    weights.

    It writes each token's keys and values into the cache's buffers and advances the cache layers' `length`
    (their `keys`/`values` views are not refreshed: nothing reads them after sampling). It holds a reference to
    every tensor the C side points into (the decoder and its fused weights, the cache, the packed copies)."""

    @staticmethod
    def usable(decoder, cache, rows: int) -> bool:
        """Float32 weights on the CPU, plain modules where C reads weights directly (embedding, norms, every layer
        fused: plain or folded LoRA projections), SiLU, one RMSNorm epsilon, a length-independent rotary
        embedding, a prefilled float32 cache of these rows; and one intra-op thread or small layers
        (_ANY_THREADS_BYTES): the C step is single-threaded."""
        inner = decoder.inner
        config = inner.config
        norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
        attn = inner.layers[0].self_attn
        if not ((torch.get_num_threads() == 1 or decoder.layer_bytes <= _ANY_THREADS_BYTES)
                and all(decoder.foldable)
                and type(inner.embed_tokens) is torch.nn.Embedding
                and all(type(n) is type(inner.norm) and isinstance(n.weight, torch.nn.Parameter) for n in norms)
                and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in inner.parameters())
                and getattr(config, "hidden_act", None) in ("silu", "swish")
                and getattr(inner.rotary_emb, "rope_type", "default") in _ROPE_TYPES
                and len({float(n.variance_epsilon) for n in norms}) == 1
                and attn.head_dim % 2 == 0 and attn.head_dim <= 512):
            return False
        layers = getattr(cache, "layers", [])
        if len(layers) != len(inner.layers) or getattr(layers[0], "key_buffer", None) is None:
            return False  # not a prefilled preallocated_cache
        shape = (rows, attn.k_proj.out_features // attn.head_dim, layers[0].key_buffer.shape[2], attn.head_dim)
        return all(b.dtype == torch.float32 and b.is_contiguous() and tuple(b.shape) == shape
                   for layer in layers for b in (layer.key_buffer, layer.value_buffer))

    def __init__(self, lib, decoder, cache, rows: int):
        inner, self.lib, self.decoder, self.cache, self.rows = decoder.inner, lib, decoder, cache, rows
        attn, buffer = inner.layers[0].self_attn, cache.layers[0].key_buffer
        capacity, d = buffer.shape[2], attn.head_dim
        cos, sin = inner.rotary_emb(buffer.new_zeros(1, 1, d), torch.arange(capacity)[None])
        self.keep = [cos[0].contiguous(), sin[0].contiguous()]  # tensors made here that the C side points into
        layers = (Layer * len(inner.layers))()  # kept (self.layers): self.model points into it
        for i, (layer, kv) in enumerate(zip(inner.layers, cache.layers)):
            products = layer_products(layer)
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for pairs in products:
                tensors += [self._pack(pairs), stacked_bias(pairs)]
            tensors += [kv.key_buffer, kv.value_buffer]
            layers[i] = Layer(*(self._pointer(t) for t in tensors))
            if i == 0:  # every layer has the same sizes
                (q_weight, _), (k_weight, _), _ = products[0]
                inter = products[3][0][0].shape[1]
        hidden, q_heads, kv_heads = inner.norm.weight.shape[0], q_weight.shape[0] // d, k_weight.shape[0] // d
        scratch = lib.lean_scratch_floats(rows, hidden, q_heads * d, kv_heads * d, inter, capacity)
        self.scratch = torch.empty(scratch, dtype=torch.float32)
        self.vocab = inner.embed_tokens.weight.shape[0]
        self.model = Model(rows, hidden, q_heads, kv_heads, d, inter, capacity, len(inner.layers),
                           float(inner.norm.variance_epsilon), float(attn.scaling),
                           self._pointer(inner.embed_tokens.weight), self._pointer(inner.norm.weight),
                           self._pointer(self.keep[0]), self._pointer(self.keep[1]), layers, self.scratch.data_ptr())
        self.layers, self.out = layers, torch.empty(rows, hidden)
        self.keep_buffer = cache.layers[0].key_buffer.data_ptr()  # where the C side reads the first layer's keys

    def _pack(self, pairs: list) -> torch.Tensor:
        """The (out, in) weights of (weight, bias) pairs, stacked along out and transposed, as one (in, out) matrix in
        the C step's panel layout (lean_pack_rows: no stacked or transposed copy is made); kept alive with the step."""
        k, n = pairs[0][0].shape[1], sum(w.shape[0] for w, _ in pairs)
        packed = torch.empty(self.lib.lean_packed_floats(k, n), dtype=torch.float32)
        column = 0
        for weight, _ in pairs:
            source = weight.detach().contiguous()  # bound to a name: alive until lean_pack_rows returns
            self.lib.lean_pack_rows(k, n, column, source.shape[0], source.data_ptr(), packed.data_ptr())
            column += source.shape[0]
        self.keep.append(packed)
        return packed

    def _pointer(self, tensor: torch.Tensor | None):
        if tensor is None:
            return None
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self.keep.append(tensor)
        return tensor.data_ptr()

    def keep_rows(self, rows: int) -> None:
        """Run the first `rows` rows from now on: the sampler has moved the rows still generating to the front of
        the cache's buffers (`kv_cache.keep_cache_rows`), which stay where the C side points."""
        if not 0 < rows <= self.rows:
            raise ValueError(f"compiled decode step: can keep 1 to {self.rows} rows, not {rows}")
        layer = self.cache.layers[0]
        if layer.key_buffer.shape[0] != rows or layer.key_buffer.data_ptr() != self.keep_buffer:
            raise ValueError("compiled decode step: the cache's rows must be moved to the front of its buffers "
                             "first (kv_cache.keep_cache_rows)")
        self.rows = self.model.rows = rows
        self.out = self.out[:rows]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, key_mask: torch.Tensor | None):
        """Same arguments and result as `decoding.LeanDecoder.hidden`, checked before C reads them; the returned
        (rows, H) tensor is overwritten by the next call (sampling consumes it first)."""
        tokens, positions = tokens.reshape(-1).contiguous(), positions.reshape(-1).contiguous()
        length, capacity = cache.layers[0].length, self.model.capacity
        if cache is not self.cache or tokens.shape[0] != self.rows or positions.shape[0] != self.rows:
            raise ValueError(f"compiled decode step: made for {self.rows} rows of its own cache; got {tokens.shape[0]} "
                             f"tokens and {positions.shape[0]} positions")
        if tokens.dtype != torch.int64 or positions.dtype != torch.int64:
            raise TypeError("compiled decode step: tokens and positions must be int64")
        if length >= capacity:
            raise RuntimeError(f"preallocated_cache: {length + 1} positions exceed the capacity {capacity}")
        low, high = (int(v) for v in torch.aminmax(tokens))
        if low < 0 or high >= self.vocab:
            raise IndexError(f"compiled decode step: token ids must be in [0, {self.vocab}) (the embedding's rows); "
                             f"got {low} .. {high}")
        low, high = (int(v) for v in torch.aminmax(positions))
        if low < 0 or high >= capacity:
            raise IndexError(f"compiled decode step: positions must be in [0, {capacity}) (the cache capacity)")
        mask, stride = None, 0
        if key_mask is not None:
            if key_mask.dtype != torch.bool or key_mask.stride(1) != 1 or tuple(key_mask.shape) != (self.rows,
                                                                                                  length + 1):
                raise ValueError(f"compiled decode step: key_mask must be a ({self.rows}, {length + 1}) bool tensor "
                                 "with contiguous rows")
            mask, stride = key_mask.data_ptr(), key_mask.stride(0)
        self.lib.lean_step(ctypes.byref(self.model), tokens.data_ptr(), positions.data_ptr(), length, mask, stride,
                           self.out.data_ptr())
        for layer in cache.layers:
            layer.length = length + 1
        return self.out


class CompiledHead:
    """The output layer's product by lean_head, the weight packed once (into `space`, a float32 CPU tensor with at
    least `packed_floats(lib, weight)` elements, when given); each call overwrites the logits of the previous one
    (sampling consumes them before the next step)."""

    def __init__(self, lib, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
                 space: torch.Tensor | None = None):
        vocab, hidden = weight.shape
        self.lib, self.hidden, self.bias = lib, hidden, None if bias is None else bias.detach().contiguous()
        floats = packed_floats(lib, weight)
        if space is None:
            self.packed = torch.empty(floats, dtype=torch.float32)
        elif space.dtype != torch.float32 or space.device.type != "cpu" or not space.is_contiguous() \
                or space.numel() < floats:
            raise ValueError(f"compiled LM head: the space to pack into must be a contiguous float32 CPU tensor of at "
                             f"least {floats} elements, got {space.dtype} {tuple(space.shape)} on {space.device}")
        else:
            self.packed = space.reshape(-1)[:floats]
        source = weight.detach().contiguous()  # bound to a name: alive until lean_pack_head returns
        lib.lean_pack_head(hidden, vocab, source.data_ptr(), self.packed.data_ptr())
        self.out = torch.empty(rows, vocab)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        h = h.detach().contiguous()
        rows, hidden = h.shape
        if h.dtype != torch.float32 or hidden != self.hidden:
            raise ValueError(f"compiled LM head: expected float32 hidden states of width {self.hidden}, got "
                             f"{h.dtype} of width {hidden}")
        out = self.out[:rows] if rows <= self.out.shape[0] else torch.empty(rows, self.out.shape[1])
        self.lib.lean_head(rows, hidden, out.shape[1], h.data_ptr(), self.packed.data_ptr(),
                           None if self.bias is None else self.bias.data_ptr(), out.data_ptr())
        return out


def packed_floats(lib, weight: torch.Tensor) -> int:
    """Elements of the packed copy of a (V, H) output layer that CompiledHead makes (V rounded up to 16, times H)."""
    return int(lib.lean_head_packed_floats(weight.shape[1], weight.shape[0]))


def sample(lib, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """`generation.sample_rows` by lean_sample for (N, V) float32 CPU logits (not modified) and (N,) uniforms:
    (first bad row or -1, tokens (N,) int64, log-probs (N,) float32). Two passes per row (the max, then the block
    sums) and one block's exps again, instead of ~8 operators that each read and write all (N, V) values (W2 of the
    benchmark: 3.5-7.5 -> 1.7 ms per token; see bench/README.md)."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or uniforms.shape != (rows,):
        raise ValueError(f"compiled sampler: expected (N, V) float32 CPU logits and (N,) uniforms, got "
                         f"{tuple(logits.shape)} {logits.dtype} on {logits.device} and {tuple(uniforms.shape)}")
    logits = logits.contiguous()
    u = uniforms.to(device="cpu", dtype=torch.float64).contiguous()
    scratch = torch.empty(lib.lean_sample_scratch_floats(vocab), dtype=torch.float32)
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float32)
    bad = lib.lean_sample(rows, vocab, logits.data_ptr(), u.data_ptr(), scratch.data_ptr(), tokens.data_ptr(),
                          logprobs.data_ptr())
    return bad, tokens, logprobs


class TileKernels:
    """The elementwise work on one float32 CPU logit tile of `grpo.engines.head.hidden_logprobs` and `hidden_loss` (their
    `kernels` argument), by lean_tile_stats, lean_tile_grad, lean_tile_exp and lean_tile_shifted_exp: one pass per
    row where torch runs ~15 operators per tile in forward and ~6 in backward, each over the whole tile."""

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def _check(x: torch.Tensor, *vectors: torch.Tensor | None) -> None:
        rows = x.shape[0]
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1
                or (rows > 1 and x.stride(0) < x.shape[1])):
            raise ValueError(f"compiled logit tiles: expected a float32 CPU (m, b) tile with contiguous, separate "
                             f"rows, got {x.dtype} {tuple(x.shape)} with strides {x.stride()} on {x.device}")
        for v in vectors:
            if v is not None and (v.dtype != torch.float32 or v.shape != (rows,) or not v.is_contiguous()
                                  or v.device.type != "cpu"):
                raise ValueError(f"compiled logit tiles: per-row values must be contiguous float32 ({rows},) on the "
                                 f"CPU, got {v.dtype} {tuple(v.shape)} on {v.device}")

    def tile_stats(self, x, inv_t: float, y, v0: int, target, run_max, s, s2) -> None:
        """Scale x by inv_t, pick each row's target logit, fold x into the running max, s and s2 (in place)."""
        self._check(x, target, run_max, s, s2)
        y = y.to(torch.int64).contiguous()
        if y.shape != (x.shape[0],) or y.device.type != "cpu":
            raise ValueError(f"compiled logit tiles: expected {x.shape[0]} targets on the CPU, got {tuple(y.shape)} on "
                             f"{y.device}")
        self.lib.lean_tile_stats(x.shape[0], x.shape[1], x.stride(0), x.data_ptr(), inv_t, y.data_ptr(), v0,
                                 target.data_ptr(), run_max.data_ptr(), s.data_ptr(),
                                 None if s2 is None else s2.data_ptr())

    def tile_exp(self, x, row_max, s, s2) -> None:
        """x <- exp(x - row_max) in place, adding the row sums of e to s and of e (x - row_max) to s2."""
        self._check(x, row_max, s, s2)
        self.lib.lean_tile_exp(x.shape[0], x.shape[1], x.stride(0), x.data_ptr(), row_max.data_ptr(), s.data_ptr(),
                               None if s2 is None else s2.data_ptr())

    def shifted_exp(self, x, shift, cap: float, s, s2, top) -> None:
        """x <- exp(min(x - shift, cap)) in place, adding the row sums of e to s and of e (x - shift) to s2, and
        folding the rows' max(x - shift) before capping into top."""
        self._check(x, shift, s, s2, top)
        self.lib.lean_tile_shifted_exp(x.shape[0], x.shape[1], x.stride(0), x.data_ptr(), shift.data_ptr(), cap,
                                       s.data_ptr(), None if s2 is None else s2.data_ptr(), top.data_ptr())

    def tile_grad(self, x, inv_t: float, lse, g, g_entropy, entropy) -> torch.Tensor:
        """x <- d loss / d logits without the target's +g, in place; returns x."""
        if (g_entropy is None) != (entropy is None):
            raise ValueError("compiled logit tiles: g_entropy and entropy come together")
        self._check(x, lse, g, g_entropy, entropy)
        self.lib.lean_tile_grad(x.shape[0], x.shape[1], x.stride(0), x.data_ptr(), inv_t, lse.data_ptr(),
                                g.data_ptr(), None if g_entropy is None else g_entropy.data_ptr(),
                                None if entropy is None else entropy.data_ptr())
        return x


def tile_kernels(dtype: torch.dtype, device: torch.device) -> TileKernels | None:
    """TileKernels for float32 CPU logits where the library is built, else None (the torch code then runs)."""
    lib = library() if dtype == torch.float32 and device.type == "cpu" else None
    return None if lib is None else TileKernels(lib)
