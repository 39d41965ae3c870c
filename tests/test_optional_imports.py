"""The trainer without `datasets` and `rich` (D18): a built-in task or a list of rows trains, the display prints plain
lines, and a data file says it needs `datasets`. Each run is a subprocess whose imports of both are blocked
(`sys.modules[name] = None` makes `import name` raise ImportError, as on an image that lacks them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.rows import Rows, as_table

ROOT = Path(__file__).resolve().parents[1]
BLOCK = "import sys\nfor name in ('datasets', 'rich'):\n    sys.modules[name] = None\n"


def run_blocked(body: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", BLOCK + body], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_rows_read_as_the_trainer_reads_a_dataset():
    rows = Rows.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    assert rows.column_names == ["prompt", "answer"] and len(rows) == 2
    assert rows[:] == {"prompt": ["a", "b"], "answer": ["1", None]} and rows[1] == {"prompt": "b", "answer": None}
    assert rows["prompt"] == ["a", "b"] and list(rows) == [rows[0], rows[1]]
    assert as_table({"prompt": ["x"]})[:] == {"prompt": ["x"]}
    with pytest.raises(ValueError, match="different lengths"):
        Rows({"prompt": ["x"], "answer": []})


TRAIN = """
import json, torch
from grpo import GRPOConfig, GRPOTrainer
from grpo.tasks import get_task
cfg = GRPOConfig(output_dir='run', model_name_or_path='tiny-arith', task='arithmetic', max_steps=2, save_steps=0,
                 report_to=[], task_eval_size=0, log_completions_steps=0, num_generations=4, prompts_per_step=4,
                 max_completion_length=16, learning_rate=1e-3, seed=0, logging_steps=1)
trainer = GRPOTrainer(args=cfg)
before = [p.detach().clone() for p in trainer.policy.parameters()]
trainer.train()
changed = sum(int((p != b).any()) for p, b in zip(trainer.policy.parameters(), before))
rows = [json.loads(l) for l in open('run/metrics.jsonl') if '"reward/total"' in l]
print('RESULT', json.dumps({'table': type(get_task('arithmetic').dataset('test', n=2)).__name__,
      'changed': changed, 'steps': len(rows), 'reward': rows[0]['reward/total']}))
own = GRPOTrainer(args=GRPOConfig(output_dir='own', model_name_or_path='tiny-arith', task=None, max_steps=1,
                  save_steps=0, report_to=[], task_eval_size=0, log_completions_steps=0, num_generations=2,
                  prompts_per_step=2, max_completion_length=8, seed=0),
                  reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
                  train_dataset=[{'prompt': 'Calculate 1 + 2\\n'}, {'prompt': 'Calculate 3 * 4\\n'}])
own.train()
print('OWN', own.step)
"""


def test_the_trainer_runs_without_datasets_and_rich(tmp_path):
    """Two steps of the arithmetic task, and one on a list of rows, with `datasets` and `rich` blocked: the task's
    rows come as `Rows`, every weight tensor moves, the display prints plain step lines; the first step's mean reward
    is the one the same run gives with both installed (the same rows, the same samples)."""
    os.symlink(ROOT / "grpo" / "assets" / "tiny-arith", tmp_path / "tiny-arith")
    blocked = run_blocked(TRAIN, tmp_path)
    assert blocked.returncode == 0, blocked.stderr[-3000:]
    result = json.loads(blocked.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["table"] == "Rows" and result["steps"] == 2 and result["changed"] > 0
    assert "step 2/2 | reward" in blocked.stdout and "OWN 1" in blocked.stdout
    (tmp_path / "with").mkdir()
    os.symlink(ROOT / "grpo" / "assets" / "tiny-arith", tmp_path / "with" / "tiny-arith")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    full = subprocess.run([sys.executable, "-c", TRAIN.split("own =")[0]], cwd=tmp_path / "with", env=env,
                          capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    reference = json.loads(full.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert reference["table"] == "Dataset" and reference["reward"] == result["reward"]


def test_a_data_file_without_datasets_says_what_to_install(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"prompt": "hi"}\n')
    body = ("from grpo.training.data.prompts import load_dataset_any\nfrom grpo.config import ConfigError\n"
            "try:\n    load_dataset_any('data.jsonl', 'train')\nexcept ConfigError as err:\n    print('ERR', err)\n")
    done = run_blocked(body, tmp_path)
    assert "ERR dataset_name: reading 'data.jsonl' needs the `datasets` package (pip install datasets)" in done.stdout
