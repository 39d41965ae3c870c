"""Atomic checkpoints: everything the next step depends on, written so a crash never leaves a half one behind.

A checkpoint is written into `checkpoint-<step>.tmp` and renamed to `checkpoint-<step>` only after every file,
`manifest.json` last, is written and flushed. Resume takes the newest directory that has a manifest; a leftover
`.tmp` is ignored and removed. Checkpoints hold: trainable weights (safetensors), optimizer and scheduler state,
the step counter, the prompt sampler's position, and every random state (Python, NumPy, torch; sampling seeds are
derived from the step, see `grpo.engines.sampling.row_seed`). Steps end at rollout boundaries, so no rollout buffer is
ever in flight when a checkpoint is written.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
PREFIX = "checkpoint-"


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


def save_checkpoint(output_dir: str | Path, step: int, weights: dict[str, torch.Tensor],
                    trainer_state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint-<step> atomically; keep the newest `keep` complete ones. Returns the final path."""
    output_dir = Path(output_dir)
    final = output_dir / f"{PREFIX}{step}"
    tmp = output_dir / f"{PREFIX}{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # Cloned: tied weights (embeddings = LM head) share memory, which safetensors refuses to write twice.
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in weights.items()}, str(tmp / "weights.safetensors"))
    torch.save(trainer_state, tmp / "trainer_state.pt")
    for name in ("weights.safetensors", "trainer_state.pt"):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    _write_json(tmp / MANIFEST, {"step": step, "files": ["weights.safetensors", "trainer_state.pt"]})
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(output_dir)
    _prune(output_dir, keep)
    return final


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    out = []
    for path in Path(output_dir).glob(f"{PREFIX}*"):
        suffix = path.name[len(PREFIX):]
        if path.is_dir() and suffix.isdigit() and (path / MANIFEST).is_file():
            out.append((int(suffix), path))
    return sorted(out)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    for leftover in Path(output_dir).glob(f"{PREFIX}*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)  # a save that was killed: never resumed from
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    weights = load_file(str(path / "weights.safetensors"))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    return weights, state


def load_latest(output_dir: str | Path, policy, optimizer) -> tuple[Path, dict[str, Any]] | None:
    """Resume from the newest complete checkpoint: its weights into `policy`, its optimizer state into `optimizer`,
    its random state into this process; returns (path, the trainer's state), or None when there is none."""
    from grpo.training.model import load_trainable_state

    path = latest_checkpoint(output_dir)
    if path is None:
        return None
    weights, state = load_checkpoint(path)
    load_trainable_state(policy, weights)
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return path, state


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
