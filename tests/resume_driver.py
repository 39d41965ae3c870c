"""Run a training job that SIGKILLs itself at a chosen point, as a crash or `kill -9` would (used by test_resume.py).

    python resume_driver.py CONFIG.json KILL_POINT KILL_STEP

KILL_POINT: none | generation | micro_step | save. KILL_STEP is 1-based.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from datasets import Dataset

import grpo.training.checkpoint.files as ckpt
import grpo.training.update.objective as objective_module
from grpo import GRPOConfig, GRPOTrainer
from rewards_for_tests import count_a


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(config_path: str, point: str, kill_step: int) -> None:
    cfg = GRPOConfig(**json.loads(open(config_path).read()))
    data = Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]})
    trainer = GRPOTrainer(reward_funcs=[count_a], args=cfg, train_dataset=data)
    at_step = lambda: trainer.step + 1 == kill_step  # noqa: E731
    if point == "generation":
        real_generate = trainer.generator.generate

        def generate(*args, **kwargs):
            if at_step():
                die()
            return real_generate(*args, **kwargs)

        trainer.generator.generate = generate
    elif point == "micro_step":
        real_loss, calls = objective_module.policy_loss, []

        def loss(*args, **kwargs):  # dies after the first micro-batch's backward of the step
            if at_step():
                calls.append(1)
                if len(calls) == 2:
                    die()
            return real_loss(*args, **kwargs)

        objective_module.policy_loss = loss
    elif point == "save":
        real_fsync_dir = ckpt._fsync_dir

        def fsync_dir(path):  # the first fsync of a save happens after the files, before the rename
            if trainer.step == kill_step and str(path).endswith(".tmp"):  # the save that ends step kill_step
                die()
            real_fsync_dir(path)

        ckpt._fsync_dir = fsync_dir
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
