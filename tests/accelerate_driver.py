"""`grpo train` under accelerate's FSDP2 or DeepSpeed on a CPU, as on a GPU machine (used by test_distributed.py and
test_sharded.py).

    accelerate launch --config_file CONFIG.yaml accelerate_driver.py train RECIPE.yaml key=value ...

Without a GPU the trainer asks accelerate for the CPU, and accelerate's CPU path then runs neither FSDP nor DeepSpeed
(it knows DDP only). Both run on a CPU: FSDP2 through torch.distributed with gloo, DeepSpeed through its CPU
accelerator. So here accelerate sees a launched process as it would on a GPU machine (backend gloo, device cpu)
and the Accelerator is made without the CPU request; everything else is `grpo train`.

Test hooks, from the environment:
    GRPO_TEST_KILL=POINT:STEP  the main process SIGKILLs itself, as a crash or `kill -9` would, in step STEP (1-based):
                               micro_step: after the first micro-batch's backward; save: when the checkpoint that ends
                               step STEP has its files but is not yet renamed into place
    GRPO_TEST_MEMORY=DIR       each process writes DIR/rank<R>.json at the end: the bytes of weights and optimizer
                               state it holds (grpo.training.setup.sharded.local_bytes)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import accelerate
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

_prepare_backend = PartialState._prepare_backend


def _as_on_a_gpu_machine_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    if int(os.environ.get("LOCAL_RANK", -1)) != -1 and not torch.cuda.is_available():
        return "gloo", DistributedType.MULTI_GPU
    return _prepare_backend(self, cpu, sagemaker_dp, backend)


_init = accelerate.Accelerator.__init__


def _as_on_a_gpu_machine(self, *args, cpu: bool = False, **kwargs):
    _init(self, *args, **kwargs)


PartialState._prepare_backend = _as_on_a_gpu_machine_backend
os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
accelerate.Accelerator.__init__ = _as_on_a_gpu_machine

import grpo.training.checkpoint.files as ckpt  # noqa: E402 - after the patch
import grpo.training.update.objective as objective_module  # noqa: E402
import grpo.training.trainer as trainer_module  # noqa: E402
from grpo.cli import main  # noqa: E402
from grpo.training.setup.sharded import local_bytes  # noqa: E402

Trainer = trainer_module.GRPOTrainer
current = {"step": 0, "losses": 0}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hooks() -> None:
    point, _, step = os.environ.get("GRPO_TEST_KILL", "").partition(":")
    train_step = Trainer.train_step

    def counted_step(self):
        current["step"], current["losses"] = self.step + 1, 0
        return train_step(self)

    Trainer.train_step = counted_step
    main_process = os.environ.get("RANK", "0") == "0"
    if point == "micro_step" and main_process:
        policy_loss = objective_module.policy_loss

        def loss(*args, **kwargs):  # dies after the first micro-batch's backward of the step
            if current["step"] == int(step):
                current["losses"] += 1
                if current["losses"] == 2:
                    die()
            return policy_loss(*args, **kwargs)

        objective_module.policy_loss = loss
    elif point == "save" and main_process:
        fsync_dir = ckpt._fsync_dir

        def fsync_before_rename(path):  # the first fsync of a save happens after the files, before the rename
            if current["step"] == int(step) and str(path).endswith(".tmp"):
                die()
            fsync_dir(path)

        ckpt._fsync_dir = fsync_before_rename
    memory = os.environ.get("GRPO_TEST_MEMORY")
    if memory:
        def step_and_measure(self):  # the most held at the end of any step
            out = counted_step(self)
            sizes = local_bytes(self.model, self.optimizer)
            path = Path(memory) / f"rank{self.accel.process_index}.json"  # (not self.rank: an SP group's is shared)
            most = json.loads(path.read_text()) if path.exists() else sizes
            path.write_text(json.dumps({k: max(v, most[k]) for k, v in sizes.items()}))
            return out

        Trainer.train_step = step_and_measure


if __name__ == "__main__":
    _hooks()
    sys.exit(main(sys.argv[1:]))
