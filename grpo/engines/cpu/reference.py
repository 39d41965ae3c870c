"""The CPU engine's reference model: a frozen copy whose weights wait in a safetensors file between reference passes.

On a CPU the reference's weights are memory the update and sampling could use; the OS's file cache holds them
instead, and may evict and re-read them. This is the CPU counterpart of verl's and OpenRLHF's reference offloading.
"""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
import weakref
from pathlib import Path

import torch


class DiskReference:
    """A frozen copy of `model` whose weights stay in a safetensors file except during a reference pass.

    The copy is built with zero-size parameters (its buffers, config and weight tying are real); `loaded()` maps
    the file's tensors in for one pass and drops them after, so the process holds the reference's weights only
    while it scores with them. Between passes they are the OS's file cache, which it may evict and re-read from
    disk. This is the CPU counterpart of verl's and OpenRLHF's reference offloading.

    The file, `<directory>/<prefix><pid>-<random>.safetensors`, is this object's own (two trainers on one output
    directory never share one), written atomically once from `model`'s weights, and deleted when this object is
    collected or at exit. Files left by processes that no longer run (a crash, kill -9) are deleted when the next
    one is made in the same directory.
    """

    def __init__(self, model, directory: str | Path, prefix: str = ".reference-"):
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _remove_orphans(directory, prefix)
        self.path = directory / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors"
        tmp = self.path.with_name(self.path.name + ".tmp")
        # named_parameters lists a tied weight once, under the name the copy will list it by too. Two parameters
        # that are one tensor under different objects are saved once (`aliases`); parts of one shared storage are
        # copied, since safetensors refuses to write tensors that overlap.
        tensors, self.aliases, seen, storages = {}, {}, {}, set()
        for name, p in model.named_parameters():
            key = (p.data_ptr(), p.dtype, tuple(p.shape), p.stride())
            if key in seen:
                self.aliases[name] = seen[key]
                continue
            seen[key] = name
            storage = p.untyped_storage().data_ptr()
            p = p.detach()
            tensors[name] = p.clone(memory_format=torch.contiguous_format) if storage in storages else p.contiguous()
            storages.add(storage)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not leave a partial copy of the model behind
            raise
        self._cleanup = weakref.finalize(self, _unlink, self.path)
        # Deep-copy everything but the weights: each parameter becomes an empty one (tied ones stay one object).
        memo = {id(p): torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=False)
                for p in model.parameters()}
        self.module = copy.deepcopy(model, memo).eval()
        self.params = dict(self.module.named_parameters())
        self.device = next(iter(self.params.values())).device if self.params else torch.device("cpu")

    def to(self, device) -> DiskReference:
        self.module.to(device)
        self.params = dict(self.module.named_parameters())  # .to may replace Parameter objects
        self.device = torch.device(device)
        return self

    @contextlib.contextmanager
    def loaded(self):
        """The reference module with its weights in place, for the duration of the block."""
        from safetensors.torch import load_file

        weights = load_file(self.path, device=str(self.device))
        try:
            for name, p in self.params.items():
                p.data = weights[self.aliases.get(name, name)]
            del weights
            yield self.module
        finally:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def close(self) -> None:
        """Delete the weights file now (the object is unusable after)."""
        self._cleanup()


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _remove_orphans(directory: Path, prefix: str) -> None:
    """Delete `prefix<pid>-*.safetensors[.tmp]` files in directory whose process is no longer running."""
    for path in directory.glob(f"{prefix}*.safetensors*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
