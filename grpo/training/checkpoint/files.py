"""Atomic checkpoints: everything the next step depends on, written so a crash never leaves a half one behind.

`checkpoint-<step>/` is a Hugging Face model directory at its top level (what `save_pretrained` writes: config.json
and model.safetensors, or for LoRA adapter_config.json and adapter_model.safetensors, plus the tokenizer's files),
so `from_pretrained` loads it, and resume reads the weights from those files. Beside them: `trainer_state.pt`
(optimizer, scheduler, prompt sampler, every random state, the step, and a rollout still feeding optimizer steps),
`trainer_state.json` (transformers' TrainerState: the step and log_history callbacks read), and `manifest.json`,
written last: the size and SHA-256 of every other file, per 256 MiB block so that threads hash the blocks in
parallel (SHA-256 runs at about 1.8 GiB/s per core with the CPU's SHA instructions; docs/runs.md). Everything goes
into `checkpoint-<step>.tmp`, each file flushed, and is renamed to `checkpoint-<step>` only then; a leftover `.tmp`
is ignored and removed. Resume checks the newest checkpoint against its manifest: one with a file missing, cut short
or changed is named in one line, and resume falls back to the newest intact one (`damaged_checkpoint: refuse` stops
instead, naming both).
With save_only_model the directory holds the model and the manifest only (it cannot be resumed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file

from grpo.training.run.errors import SaveFailed, resume_hint

MANIFEST = "manifest.json"
PREFIX = "checkpoint-"
STATE = "trainer_state.pt"
DIGEST = "sha256"  # (measured against blake2b, sha1 and md5 on a 1 GiB file: the fastest with SHA-NI, docs/runs.md)
BLOCK = 1 << 28  # a digest per 256 MiB block, so the blocks of every file are hashed by parallel threads


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries (or a file's data) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def save_checkpoint(output_dir: str | Path, step: int, write_model: Callable[[Path], None],
                    trainer_state: dict[str, Any] | None, keep: int | None,
                    write_json: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoint-<step> atomically: `write_model(dir)` writes the model directory's files, `trainer_state`
    (None: save_only_model) goes to trainer_state.pt, `write_json(path)` writes trainer_state.json. Keeps the
    newest `keep` complete checkpoints (None: all). Returns the final path."""
    output_dir = Path(output_dir)
    final = output_dir / f"{PREFIX}{step}"
    tmp = output_dir / f"{PREFIX}{step}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        write_model(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / STATE)
        if write_json is not None:
            write_json(tmp / "trainer_state.json")
        share_files(tmp)
        files = file_records(tmp, file_names(tmp))
        _write_json(tmp / MANIFEST, {"step": step, "files": files, "resumable": trainer_state is not None})
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(output_dir)
    except Exception as err:  # noqa: BLE001 - a full disk reaches us as OSError, torch's RuntimeError, SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)  # (the space it took back, for whatever comes next)
        raise write_failed(final, err) from err
    if keep is not None:
        _prune(output_dir, keep)
    return final


def file_names(root: Path) -> list[str]:
    """Every file under `root` but the manifest, as paths relative to it (sorted)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_records(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The manifest's record of each file: its size and the digests of its 256 MiB blocks, hashed by a pool of
    threads (hashlib lets go of the GIL), so a multi-GB checkpoint costs its largest block's time per core; each
    file is flushed to disk on the way (it was just written)."""
    from concurrent.futures import ThreadPoolExecutor

    sizes = {name: (root / name).stat().st_size for name in names}
    blocks = [(name, start) for name in names for start in range(0, max(sizes[name], 1), BLOCK)]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1, max(len(blocks), 1))) as pool:
        digests = list(pool.map(lambda block: _block_digest(root / block[0], block[1]), blocks))
        list(pool.map(lambda name: _fsync_dir(root / name), names))
    out = {name: {"bytes": sizes[name], DIGEST: []} for name in names}
    for (name, _), digest in zip(blocks, digests):
        out[name][DIGEST].append(digest)
    return out


def _block_digest(path: Path, start: int) -> str:
    digest = hashlib.new(DIGEST)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in range(start, start + BLOCK, 1 << 24):
            data = os.pread(fd, min(1 << 24, start + BLOCK - offset), offset)
            if not data:
                break
            digest.update(data)
    finally:
        os.close(fd)
    return digest.hexdigest()


def damage(path: str | Path) -> str | None:
    """None when checkpoint `path` is whole (every file its manifest names, of that size and digest), else what is
    wrong, in a few words. A manifest of grpo before digests (a list of names) is checked for the files' presence."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST).read_text()).get("files", [])  # (older sharded ones: none)
    except (OSError, ValueError, AttributeError) as err:
        return f"its {MANIFEST} is unreadable ({type(err).__name__})"
    records = files if isinstance(files, dict) else {name: None for name in files}
    for name, want in records.items():
        target = path / name
        if not target.is_file():
            return f"{name} is missing"
        if want is None:  # (a manifest of names only)
            continue
        size = target.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, its manifest says {want['bytes']}"
        if DIGEST in want and file_records(path, [name])[name][DIGEST] != want[DIGEST]:
            return f"{name} has changed since it was written ({DIGEST} differs from its manifest's)"
    return None


def write_failed(target: Path, err: BaseException) -> SaveFailed:
    """The error of a checkpoint or final/ that could not be written: which path, why (with the space left, since a
    full disk reaches torch.save as a bare RuntimeError), and the newest complete checkpoint, which is intact."""
    reason = f"{type(err).__name__}: {err}"
    if isinstance(err, OSError) and err.strerror:
        reason = err.strerror + (f" ({err.filename})" if err.filename else "")
    free = free_space(target.parent)
    found = [path for _, path in complete_checkpoints(target.parent) if path != target]
    last = (f"the newest complete checkpoint, {found[-1]}, is intact: free space or fix the permission, then "
            f"resume: {resume_hint()}" if found else "no complete checkpoint was written before it")
    return SaveFailed(f"could not write {target}: {reason}{free}. {last}")


def free_space(directory: Path) -> str:
    """"; <n> MiB free there" (a full disk reaches torch.save and safetensors as a bare error), or "" if unknown."""
    try:
        return f"; {shutil.disk_usage(directory).free / 2**20:.1f} MiB free there"
    except OSError:
        return ""


@contextlib.contextmanager
def writing(target: str | Path, main: bool = True):
    """A write of final/ (or another model directory), as a checkpoint's: the caller writes into the directory this
    yields (`<target>.tmp`, beside it), whose files move into `target` only once every one is written, so a full
    disk never leaves a half-written `target` (config.json and no weights). `target` made by the move (os.replace)
    when it did not exist; else each written entry replaces its namesake there (others, a user's, stay). Whatever
    the write raises becomes SaveFailed (write_failed), the temporary directory removed. The files get the mode the
    umask allows (share_files). `main`: the process that makes, moves and removes the directory (the others of a
    sharded save write nothing)."""
    target = Path(target).absolute()
    tmp = target.with_name(target.name + ".tmp")
    try:
        if main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        yield tmp
        if main:
            share_files(tmp)
            _move_into(tmp, target)
    except Exception as err:  # noqa: BLE001 - a full disk: OSError, torch's RuntimeError, SafetensorError
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(target, err) from err


def _move_into(tmp: Path, target: Path) -> None:
    """The written directory `tmp` becomes `target` (renames only: no space needed, nothing half-written)."""
    if not target.exists():
        os.replace(tmp, target)
        return
    for entry in tmp.iterdir():
        there = target / entry.name
        if there.is_dir() and not there.is_symlink():
            shutil.rmtree(there)
        os.replace(entry, there)
    tmp.rmdir()


def share_files(root: Path) -> None:
    """Give the files under `root` the mode a plain open() would (0666 less the umask: 0644 by default).
    transformers writes model.safetensors through a temporary file made by mkstemp, which is 0600: teammates on a
    shared cluster could not read the model."""
    umask = os.umask(0)
    os.umask(umask)  # (reading the umask means setting it; put straight back)
    mode = 0o666 & ~umask
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    return [(step, path) for step, path in checkpoint_dirs(output_dir) if (path / MANIFEST).is_file()]


def checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint-<step> directory, complete or not (its manifest deleted), oldest first."""
    out = []
    for path in Path(output_dir).glob(f"{PREFIX}*"):
        suffix = path.name[len(PREFIX):]
        if path.is_dir() and suffix.isdigit():
            out.append((int(suffix), path))
    return sorted(out)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    for leftover in Path(output_dir).glob(f"{PREFIX}*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)  # a save that was killed: never resumed from
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """trainer_state.pt of a checkpoint; a ConfigError-worthy ValueError for one written with save_only_model (its
    manifest says so: a resumable checkpoint whose state is missing is damaged, see `damage`)."""
    path = Path(path)
    if not (path / STATE).is_file():
        if json.loads((path / MANIFEST).read_text()).get("resumable", True):
            raise ValueError(f"{path} is damaged: {STATE} is missing; resume from an earlier checkpoint.")
        raise ValueError(f"{path} holds the model only (written with save_only_model): it cannot be resumed; "
                         "load it with from_pretrained, or resume from a full checkpoint.")
    # On the CPU: without map_location every process of a DDP resume would put rank 0's optimizer state (twice the
    # fp32 model for AdamW) on the device it was saved from, cuda:0 (gpu_review2 N2); load_state_dict moves each
    # piece to its parameter's device.
    return torch.load(path / STATE, weights_only=False, map_location="cpu")


def model_weights(path: str | Path, adapters: bool) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's model files: the adapters (LoRA) or every shard of the model."""
    path = Path(path)
    if (path / "weights.safetensors").is_file():  # (checkpoints of grpo before the Hugging Face layout)
        return load_file(str(path / "weights.safetensors"))
    if adapters:
        return load_file(str(path / "adapter_model.safetensors"))
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(path / name)))
    return weights


def resolve_resume(output_dir: str | Path, requested: Any, damaged: str = "fall_back") -> Path | None:
    """The checkpoint a run continues from: True means the newest intact one in output_dir (None when there is
    none; a damaged newer one is named in a line, or with damaged="refuse" a ValueError naming both), a path that
    directory (a ValueError when it is not a complete, intact checkpoint), None/False none."""
    if requested is None or requested is False:
        return None
    if requested is not True:
        path = Path(requested)
        if not (path / MANIFEST).is_file():
            raise ValueError(f"resume_from_checkpoint: {str(path)!r} is not a complete checkpoint (no {MANIFEST}).")
        if (why := damage(path)) is not None:
            raise ValueError(f"resume_from_checkpoint: {path} is damaged: {why}; resume from an earlier checkpoint.")
        return path
    latest_checkpoint(output_dir)  # (a half-written .tmp removed)
    found = checkpoint_dirs(output_dir)
    newest = found[-1][1] if found else None
    bad: list[str] = []
    for _, path in reversed(found):  # (one whose manifest was deleted: named, as a damaged one is)
        why = damage(path) if (path / MANIFEST).is_file() else f"{MANIFEST} is missing"
        if why is None:
            break
        bad.append(f"{path} is damaged: {why}")
    else:
        path = None
    if not bad:
        return path
    if path is None:
        raise ValueError(f"resume: {'; '.join(bad)}; no intact checkpoint is left in {output_dir}: start over with "
                         "overwrite_output_dir: true, or another output_dir.")
    if damaged == "refuse":
        raise ValueError(f"resume: {'; '.join(bad)}. The newest intact checkpoint is {path}: resume from it with "
                         f"damaged_checkpoint: fall_back (or resume_from_checkpoint: {path}), or restore {newest}.")
    print(f"resume: {'; '.join(bad)}. Falling back to {path}, the newest intact checkpoint.")
    return path


def _prune(output_dir: Path, keep: int) -> None:
    for _, path in complete_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def save_nonfinite_inputs(output_dir: str | Path, step: int, rank: int, batch) -> Path:
    """A step's tensors and sample texts (a `RolloutBatch`), so a NaN can be reproduced and inspected offline."""
    path = Path(output_dir) / "nonfinite" / f"step_{step:06d}_rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = ("input_ids", "attention_mask", "completion_mask", "advantages", "old_logp", "ref_logp")
    torch.save({**{f: getattr(batch, f) for f in fields}, "samples": batch.samples}, path)
    return path
