"""The tiny vision model (grpo/assets/tiny-vision) on the shapes task in several processes: each process samples and
trains on its share of the rows with those rows' own pixels, so 2 processes (torch.distributed with gloo, on CPU)
reach the 1-process run's weights, as the text model does in test_distributed.py; and under FSDP2 (accelerate, 2
processes, as test_sharded.py launches it).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from test_distributed import assert_same_run, job, run
from test_sharded import KINDS, free_port, launch

ASSET = "tiny-vision"
RECIPE = """\
model_name_or_path: tiny-vision
task: shapes
task_train_size: 32
task_eval_size: 0
num_generations: 8
prompts_per_step: 4
per_device_train_batch_size: 8
max_completion_length: 6
learning_rate: 1.0e-3
beta: 0.04
max_steps: 3
save_steps: 0
report_to: []
log_completions_steps: 0
"""


@pytest.fixture(scope="module")
def vision_job(tmp_path_factory):
    """The recipe in a directory of its own, the one-process run of it made once: (directory, environment)."""
    base = tmp_path_factory.mktemp("vision")
    env = job(base, ASSET)
    (base / "recipe.yaml").write_text(RECIPE)
    run(["-m", "grpo.cli"], base / "one", env, overrides=["engine=transformers"])
    return base, env


def weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


def test_two_processes_with_images_match_one(vision_job):
    """Each process's 16 rows (2 of the 4 prompts, 8 completions each) take their own pictures through sampling, the
    old/reference passes and 2 micro-batches of the update; the all-reduced gradients are the one process's (4
    micro-batches), so rewards, gradient norms, loss metrics and weights agree as for text (assert_same_run; measured
    1.2e-5 apart)."""
    base, env = vision_job
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m",
         "grpo.cli"], base / "two", env, overrides=["engine=transformers"])
    assert_same_run(base / "one", base / "two", weights(base / "one"), weights(base / "two"))


@pytest.mark.parametrize("kind,gather", [("fsdp2", True), pytest.param("fsdp2", False, marks=pytest.mark.slow),
                                         pytest.param("zero3", True, marks=[*KINDS[1].marks, pytest.mark.slow])],
                         ids=["fsdp2", "fsdp2-sharded-sampling", "zero3"])
def test_sharded_weights_with_images_match_one_process(vision_job, kind, gather):
    """FSDP2 or DeepSpeed ZeRO-3 (accelerate, 2 processes on the CPU; each decoder layer and vision block sharded),
    sampling from the weights gathered for the rollout or (FSDP2) through the sharded model, each forward collective,
    the prompts' with their pixels included: the same rewards and gradient norms at every step as the one process,
    and its weights up to float32 rounding (measured 1.2e-5 apart FSDP2, 1.0e-5 ZeRO-3, as DDP); final/ loads as a
    vision-language model, under the hub's names (ZeRO-3's load records transformers' legacy renamings, which
    undone named the language model's weights model.model.*: grpo.training.checkpoint.sharded._hub_names)."""
    from transformers import AutoModelForImageTextToText

    base, env = vision_job
    out = base / f"{kind}-{gather}"
    run(launch(base, kind, "--main_process_port", str(free_port())), out, env,
        overrides=["engine=transformers", f"ds3_gather_for_generation={str(gather).lower()}"])
    assert_same_run(base / "one", out, weights(base / "one"), weights(out), grad_rel=1e-5 if kind == "fsdp2" else 1e-4)
    AutoModelForImageTextToText.from_pretrained(out / "final")
    assert (out / "final" / "preprocessor_config.json").exists()  # (the image processor beside it)


def test_a_process_whose_rows_have_no_image_still_trains_the_vision_tower(tmp_path):
    """DDP over 2 gloo processes, the vision tower trainable, rank 0's rows with pictures and rank 1's without: rank 1
    runs a blank stand-in image through the vision side at zero weight, so both processes give the vision
    parameters gradients, three steps complete and the vision weights stay equal across them. Before (gpu_review2
    N6): DDP's "Expected to have finished reduction in the prior iteration" at step 2 (tests/vision_ddp_driver.py)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = job(tmp_path, ASSET)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), str(here / "vision_ddp_driver.py"), str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)
               if (tmp_path / f"rank{r}.json").is_file()]
    assert len(reports) == 2, result.stderr[-3000:]
    assert all(r == {"steps": 3, "error": None, "vision_equal": True} for r in reports), reports
