"""TRL's own GRPO tests, adapted by scripts/adapt_trl_tests.py (test_grpo_trainer.py): the local stand-ins of TRL's
hub models and datasets are built once per session (scripts/build_trl_test_assets.py, into a temporary directory
unless TRL_SUITE_ASSETS names one), and each of TRL's tests is marked skipped (with the reason: SKIPS) or slow
(all but FAST, the quick subset). The same file runs TRL itself (`--target trl`): docs/from_trl.md has both counts."""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]  # (a copy elsewhere: the script writes this repository's path here)
sys.path.insert(0, os.path.dirname(__file__))
# The adapted file is generated locally from a TRL checkout and kept out of git (TRL's code is not committed here):
# without it this folder holds no tests, and nothing is built.
ADAPTED = Path(__file__).with_name("test_grpo_trainer.py")
if ADAPTED.exists() and "TRL_SUITE_ASSETS" not in os.environ:
    _spec = importlib.util.spec_from_file_location("build_trl_test_assets",
                                                   REPO / "scripts" / "build_trl_test_assets.py")
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    os.environ["TRL_SUITE_ASSETS"] = tempfile.mkdtemp(prefix="trl-suite-assets-")
    _module.build(Path(os.environ["TRL_SUITE_ASSETS"]))

_PRIVATE = "reads TRL's private {what} by name"
_TRL_TOO = "cannot run under TRL either on this machine: {why}"
# test (or class) name -> why it is skipped on both targets. Only two reasons are allowed: the test reads TRL's
# private internals by name, or it cannot pass under TRL on this machine (docs/from_trl.md lists each).
SKIPS = {
    "TestGRPORolloutDispatch": _PRIVATE.format(what="_generate (its dispatch, on a hand-built trainer)"),
    "test_entropy_bonus_flows_gradients": _PRIVATE.format(what="_get_per_token_logps_and_entropies"),
    "TestGRPOTrainerVLM": _TRL_TOO.format(why="the hub's tiny vision-language models are not built locally"),
    "test_train_with_tools_multimodal_response": _TRL_TOO.format(why="a hub vision-language model, not built "
                                                                     "locally"),
    "TestGRPOTrainerSlow": _TRL_TOO.format(why="GPU tests (Liger, bitsandbytes, vLLM, kernels); the suite runs on "
                                               "the CPU"),
    "test_trust_remote_code": _TRL_TOO.format(why="the hub's remote-code model (tiny-RemoteForCausalLM), not built "
                                                  "locally"),
    "test_compute_liger_loss_passes_vllm_is_ratio": _TRL_TOO.format(why="Liger kernels (GPU)"),
    "test_liger_kernel_with_peft_lm_head_raises": _TRL_TOO.format(why="Liger kernels (GPU)"),
    "test_liger_kernel_with_peft_non_lm_head_target_allowed": _TRL_TOO.format(why="Liger kernels (GPU)"),
    "test_liger_kernel_with_peft_modules_to_save_lm_head_allowed": _TRL_TOO.format(why="Liger kernels (GPU)"),
    "test_liger_kernel_with_peft_prompt_learning_raises": _TRL_TOO.format(why="Liger kernels (GPU)"),
}
# the quick subset (seconds each): the mask methods, init-time checks and errors, two short trainings
FAST = ("TestGetHighEntropyMask", "test_get_off_policy_mask", "test_get_off_policy_mask_padding", "test_init_minimal",
        "test_train_dataset_format", "test_init_with_eval_dataset", "test_no_reward_source_raises",
        "test_dataset_required_without_environment", "test_environment_owned_data_requires_max_steps",
        "test_multiple_environments_without_dataset_raises", "test_mismatched_reward_processing_classes_length",
        "test_correct_reward_processing_classes_list", "test_single_reward_model_with_single_processing_class",
        "test_warning_raised_sequence_level_with_token_summed_loss", "test_iterable_dataset_forces_num_workers_zero")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().parent != here:  # (the hook sees the whole session's tests)
            continue
        names = [getattr(item, "originalname", item.name)]
        if item.cls is not None:
            names.append(item.cls.__name__)
        reason = next((SKIPS[n] for n in names if n in SKIPS), None)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif not any(n in FAST for n in names):
            item.add_marker(pytest.mark.slow)
