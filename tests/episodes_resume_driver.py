"""Train the shipped tiny tools model through the endpoint (an `Episodes` agent of the openai client) and SIGKILL
the process inside an episode of a chosen step, as a crash or `kill -9` would (used by test_episodes.py).

    python episodes_resume_driver.py CONFIG.json KILL_STEP         # KILL_STEP 0: no kill
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.agents import Episodes
from grpo.tasks import calculator as calculator_task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_episodes import calculator_agent  # noqa: E402


def main(config_path: str, kill_step: int) -> None:
    cfg = GRPOConfig(**json.loads(Path(config_path).read_text()))
    agent = calculator_agent()

    def episode(client, row):
        if trainer.step + 1 == kill_step:  # (in the middle of the step's episodes, some calls made)
            os.kill(os.getpid(), signal.SIGKILL)
        return agent(client, row)

    trainer = GRPOTrainer(model=cfg.model_name_or_path, args=cfg, reward_funcs=[],
                          train_dataset=Dataset.from_list(calculator_task.rows("train", 8, seed=0)),
                          rollout_func=Episodes(episode))
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
