"""The compiled decode step (grpo/csrc/lean_step.c): built on first use with the system C compiler, loaded with ctypes.

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
import tempfile
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "lean_step.c"
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
    return Path(os.environ.get("GRPO_CACHE_DIR") or Path.home() / ".cache" / "grpo") / "native"


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _build(compiler: list[str], target: Path, flags: list[str] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        result = subprocess.run([*compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                timeout=120)
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
        log.info("grpo.native: no C compiler found; sampling uses the torch step")
        return None
    compiler = shlex.split(found)  # CC may carry a launcher or flags, e.g. "ccache gcc"
    try:
        key = hashlib.sha256("\n".join([SOURCE.read_text(), *compiler, *FLAGS, _cpu_tag()]).encode()).hexdigest()
        target = _cache_dir() / f"lean_step-{key[:16]}.so"
        if not target.exists():
            try:
                _build(compiler, target)
            except RuntimeError:  # a compiler without -march=native (some clang and non-x86 gcc builds)
                _build(compiler, target, [f for f in FLAGS if f != "-march=native"])
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("grpo.native: could not build the compiled decode step (%s); sampling uses the torch step", err)
        return None
    return _declare(lib)


def _declare(lib):
    """Set the argument and result types of the library's functions (ctypes would guess ints otherwise)."""
    lib.lean_step.argtypes = [ctypes.POINTER(Model), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.lean_step.restype = None
    lib.lean_packed_floats.argtypes = [ctypes.c_int32, ctypes.c_int32]
    lib.lean_packed_floats.restype = ctypes.c_int64
    lib.lean_pack.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
    lib.lean_pack.restype = None
    lib.lean_head_packed_floats.argtypes = [ctypes.c_int32, ctypes.c_int32]
    lib.lean_head_packed_floats.restype = ctypes.c_int64
    lib.lean_pack_head.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
    lib.lean_pack_head.restype = None
    lib.lean_head.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p]
    lib.lean_head.restype = None
    lib.lean_scratch_floats.argtypes = [ctypes.c_int32] * 6
    lib.lean_scratch_floats.restype = ctypes.c_int64
    return lib
