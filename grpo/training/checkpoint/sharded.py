"""Checkpoints of a run whose state is sharded over processes: FSDP2 and DeepSpeed (ZeRO-3 shards the weights too;
ZeRO-1/2 the optimizer state).

`checkpoint-<step>/` holds, like a one-process checkpoint, the policy as a Hugging Face model directory at its top
level (gathered whole on the main process, so `from_pretrained` loads it; with LoRA, the adapter), and:

    sharded/            FSDP2: the model's and the optimizer's state, each process writing its own shards
                        (torch.distributed.checkpoint, which can also load them into another number of processes)
    deepspeed/          DeepSpeed: its own checkpoint (each process's partitions of weights and optimizer state)
    trainer_state.pt    step, scheduler, prompt sampler, counters, and each process's random state and rows of a
                        rollout still feeding optimizer steps (grpo.training.checkpoint.state), gathered to the main process
    manifest.json       written last, by the main process, after every process has written its part: the size
                        and SHA-256 of every file (each process reads its share of the files), which resume
                        checks (grpo.training.checkpoint.files.damage)

Resume loads the sharded state, not the gathered copy, so weights and optimizer continue exactly. Every process
writes into `checkpoint-<step>.tmp`, and the main process renames it only after all have finished and the manifest
is written: a crash of any process at any point leaves the last complete checkpoint as it was. `output_dir` must be
on a filesystem every machine of the run sees. Every function here is collective: all processes call it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch

from grpo.config import ConfigError
from grpo.engines.images import is_vision_config
from grpo.engines.sharding import hf_weights, is_peft, sharding, whole_tensors
from grpo.training.checkpoint import files as ckpt

def _backend(accelerator) -> str:
    return "deepspeed" if accelerator.distributed_type == "DEEPSPEED" else "sharded"


def _on_main(accelerator, items) -> dict[str, torch.Tensor]:
    """Gather (name, tensor) items on every process (each one collective); the main process keeps CPU copies."""
    kept, copies = {}, {}  # a tensor under two names (tied weights) stays one, so save_pretrained writes it once
    for name, tensor in items:
        if accelerator.is_main_process:
            source, copy = copies.get(id(tensor), (lambda: None, None))
            if source() is not tensor:  # (an id is reused once its tensor is gone)
                copy = tensor.to("cpu", copy=True).contiguous()
                copies[id(tensor)] = weakref.ref(tensor), copy
            kept[name] = copy
    return kept


def write_hf(accelerator, policy, tokenizer, path: Path, merged: bool = False) -> None:
    """The policy as a Hugging Face directory at `path`, gathered on the main process: the model, or with LoRA the
    adapter (`merged`: the model with the adapters merged in), and `tokenizer` unless None. Collective; the main
    process writes."""
    if merged:
        weights, model = _on_main(accelerator, hf_weights(policy)), policy.get_base_model()
    elif is_peft(policy):
        weights, model = _on_main(accelerator, whole_tensors(policy, keep=lambda n: "lora_" in n
                                                            or "modules_to_save" in n)), policy
    else:
        weights, model = _on_main(accelerator, whole_tensors(policy)), policy
    if accelerator.is_main_process:
        with _hub_names(model):
            model.save_pretrained(path, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


@contextlib.contextmanager
def _hub_names(model):
    """Under ZeRO-3, save_pretrained undoing only the renamings a model made from scratch has (a vision-language
    model's `model.language_model.*` -> `model.*`, `model.visual.*` -> `visual.*`): transformers' ZeRO-3 load
    records its legacy renamings too, and undoing those names the language model's weights `model.model.*`, which
    no load maps back. (FSDP2's model keeps the renamings its load recorded: its class is FSDP's, which
    transformers' table of renamings does not know.)"""
    vision = is_vision_config(getattr(model, "config", None)) and sharding(model) == "zero3"
    recorded = getattr(model, "_weight_conversions", None)
    if vision and recorded is not None:
        model._weight_conversions = None
    try:
        yield
    finally:
        if vision and recorded is not None:
            model._weight_conversions = recorded


def save_final(accelerator, policy, tokenizer, path, merge: bool, adapter_dir: str = "adapter") -> None:
    """`final/` of a sharded run: what `grpo.training.setup.model.save_final` writes for one process (a model that
    `from_pretrained` loads; with LoRA also the adapter in `path/adapter_dir`), gathered on the main process."""
    with ckpt.writing(path, main=accelerator.is_main_process) as into:  # (moved into `path` once whole)
        if is_peft(policy):
            write_hf(accelerator, policy, None, into / adapter_dir)
        if merge or not is_peft(policy):
            write_hf(accelerator, policy, None, into, merged=is_peft(policy))
        if accelerator.is_main_process:
            tokenizer.save_pretrained(into)  # (a vision-language model's processor too: grpo.training.data.vision)
    accelerator.wait_for_everyone()


def save(accelerator, model, policy, optimizer, tokenizer, output_dir, step: int, state: dict[str, Any] | None,
         keep: int | None, write_json=None) -> Path:
    """Write checkpoint-<step> (see the module's docstring). `model` and `optimizer` as accelerate prepared them,
    `policy` the unwrapped model, `state` the trainer's own state (grpo.training.checkpoint.state; None: the model only, as
    save_only_model asks), `write_json(path)` writes trainer_state.json."""
    output_dir = Path(output_dir)
    final, tmp = output_dir / f"{ckpt.PREFIX}{step}", output_dir / f"{ckpt.PREFIX}{step}.tmp"
    main, backend = accelerator.is_main_process, _backend(accelerator)
    try:  # (a process whose part fails stops; the others, at the next barrier, are ended by the launcher)
        if main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        write_hf(accelerator, policy, tokenizer, tmp)
        if state is not None:
            if backend == "deepspeed":
                model.save_checkpoint(str(tmp / backend), tag="state", save_latest=False)
            else:
                import torch.distributed.checkpoint as dcp

                dcp.save(_fsdp_state(model, optimizer), checkpoint_id=str(tmp / backend))
        if main:
            if state is not None:
                torch.save(state, tmp / ckpt.STATE)
            if write_json is not None:
                write_json(tmp / "trainer_state.json")
        accelerator.wait_for_everyone()  # every process's part is on disk
        if main:
            ckpt.share_files(tmp)
        files = _records(accelerator, tmp)
        if main:
            for part in sorted(tmp.rglob("*")):  # (the directories that hold every process's files)
                if part.is_dir():
                    ckpt._fsync_dir(part)
            ckpt._write_json(tmp / ckpt.MANIFEST, {"step": step, "format": backend, "resumable": state is not None,
                                                   "processes": accelerator.num_processes, "files": files})
            ckpt._fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            ckpt._fsync_dir(output_dir)
    except Exception as err:  # noqa: BLE001 - a full disk: OSError, torch's RuntimeError, SafetensorError
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ckpt.write_failed(final, err) from err
    if main and keep is not None:  # (only once the new checkpoint is complete)
        ckpt._prune(output_dir, keep)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, model, optimizer, path: Path) -> None:
    """The sharded weights and optimizer state of checkpoint `path` into `model` and `optimizer` (as accelerate
    prepared them). Collective; the trainer's own state is read by grpo.training.checkpoint.state."""
    path = Path(path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    backend = _backend(accelerator)
    if manifest.get("format") != backend:
        raise ConfigError(f"resume: {path} was written by a {manifest.get('format', 'one-process')} run, this run is "
                          f"{backend}; resume with the launch configuration that wrote it.")
    if backend == "deepspeed":
        if manifest["processes"] != accelerator.num_processes:
            raise ConfigError(f"resume: {path} holds DeepSpeed partitions of {manifest['processes']} processes, this "
                              f"run has {accelerator.num_processes}; resume with {manifest['processes']}.")
        loaded, _ = model.load_checkpoint(str(path / backend), tag="state", load_optimizer_states=True,
                                          load_lr_scheduler_states=False)
        if loaded is None:  # (DeepSpeed only logs a checkpoint it cannot find)
            raise FileNotFoundError(f"resume: DeepSpeed found no checkpoint in {path / backend}")
    else:
        _load_fsdp(model, optimizer, path / backend)


def _fsdp_state(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer.optimizer)  # (accelerate's wrapper holds the torch optimizer)
    return {"model": weights, "optimizer": optim}


def _load_fsdp(model, optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _fsdp_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _records(accelerator, tmp: Path) -> dict[str, Any]:
    """The manifest's size and digest of every file of the checkpoint (flushed on the way), each process taking
    every num_processes-th file, so the reading is shared out. Collective."""
    names = ckpt.file_names(tmp) if accelerator.is_main_process else None
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [names]
        broadcast_object_list(box)
        names = box[0]
    mine = list(ckpt.file_records(tmp, names[accelerator.process_index::accelerator.num_processes]).items())
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        mine = gather_object(mine)
    return dict(sorted(mine))
