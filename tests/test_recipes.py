"""Every recipe shipped in the repo loads and validates, and the process-supervision recipe trains a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.cli import DEFAULT_RECIPE, main
from grpo.config import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml")) + [DEFAULT_RECIPE]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_loads(recipe):
    cfg = GRPOConfig.load(recipe)
    tasks = {"calculator_tools.yaml": "calculator", "vision_shapes.yaml": "shapes"}
    assert cfg.task == tasks.get(recipe.name, "arithmetic")
    if cfg.task == "calculator":  # the tool task's model is the shipped tool-calling one, named by its name
        assert cfg.tools == ["calculator"] and cfg.model_name_or_path == str(ROOT / "grpo" / "assets" / "tiny-tools")
        assert (Path(cfg.model_name_or_path) / "config.json").is_file()
    if cfg.task == "shapes":  # the vision task's model is the shipped tiny Qwen2-VL, with its image processor
        assert cfg.model_name_or_path == str(ROOT / "grpo" / "assets" / "tiny-vision")
        assert (Path(cfg.model_name_or_path) / "preprocessor_config.json").is_file()


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes" / "gpu").glob("*.yaml")), ids=lambda p: p.name)
def test_gpu_recipe_loads(recipe):
    """The GPU recipes name a hub model and dataset (not reachable here): they load and validate, and train float32
    weights under bf16 autocast (AdamW on bf16 weights at lr 1e-6 rounds almost every step away:
    tests/test_precision.py)."""
    from grpo.training.setup.launch import make_accelerator

    cfg = GRPOConfig.load(recipe)
    assert cfg.task is None and cfg.dataset_name and (cfg.torch_dtype, cfg.bf16) == ("float32", True)
    assert make_accelerator(cfg).mixed_precision == "bf16"


def test_process_supervision_recipe_runs(tmp_path):
    code = main(["train", str(ROOT / "recipes" / "process_supervision.yaml"), f"output_dir={tmp_path / 'run'}",
                 "max_steps=1", "prompts_per_step=2", "eval_steps=0", "task_eval_size=0", "report_to=[]",
                 "task_train_size=50"])
    assert code == 0
    assert "reward/step/mean" in (tmp_path / "run" / "metrics.jsonl").read_text()
