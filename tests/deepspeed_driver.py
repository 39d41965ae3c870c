"""`grpo train` under accelerate's DeepSpeed on a CPU (used by test_distributed.py).

    accelerate launch --config_file DEEPSPEED.yaml deepspeed_driver.py train RECIPE.yaml key=value ...

The trainer asks accelerate for the CPU when there is no GPU, and accelerate then leaves DeepSpeed out. DeepSpeed
itself runs on a CPU (its CPU accelerator, gloo), so here the trainer's Accelerator is made without that request,
as it is on a GPU machine; everything else is `grpo train`.
"""

from __future__ import annotations

import sys

import accelerate

_init = accelerate.Accelerator.__init__


def _as_on_a_gpu_machine(self, *args, cpu: bool = False, **kwargs):
    _init(self, *args, **kwargs)


accelerate.Accelerator.__init__ = _as_on_a_gpu_machine

from grpo.cli import main  # noqa: E402 - after the patch

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
