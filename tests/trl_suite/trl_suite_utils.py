"""TRL's test helpers (its tests/testing_utils.py) for the adapted suite, and `load_dataset` reading the local
stand-in of `trl-internal-testing/zen`."""

import importlib.util
import os

import datasets
import pytest
import torch

ASSETS = os.environ["TRL_SUITE_ASSETS"]  # (set by conftest.py, which builds them)


def _has(module):
    return importlib.util.find_spec(module) is not None


class TrlTestCase:
    @pytest.fixture(autouse=True)
    def set_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)


def _needs(ok, what):
    return pytest.mark.skipif(not ok, reason=f"test requires {what}")


require_bitsandbytes = _needs(_has("bitsandbytes") and torch.cuda.is_available(), "bitsandbytes on a GPU")
require_jmespath = _needs(_has("jmespath"), "jmespath")
require_kernels = _needs(_has("kernels"), "kernels")
require_liger_kernel = _needs(_has("liger_kernel"), "liger-kernel")
require_peft = _needs(_has("peft"), "peft")
require_torch_accelerator = _needs(torch.cuda.is_available(), "an accelerator")
require_vision = _needs(False, "the hub's tiny vision-language models (not built locally: TRL cannot run them "
                               "here either)")
require_vllm = _needs(False, "vLLM on a GPU")


def is_liger_kernel_available(min_version=None):
    return _has("liger_kernel")  # (not installed here; versions are not compared)


def is_ampere_or_newer(device_index=0):
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device_index) >= (8, 0)


def float32_by_default():
    """TRL's bf16 default (true unless fp16) is refused by transformers on a machine without a bf16 GPU: the suite
    runs TRL in float32 (grpo's CPU default) unless a test sets bf16 itself. Called by the file adapted for TRL
    (`--target trl`) only: it changes trl.GRPOConfig's default for the whole session."""
    import trl

    init = trl.GRPOConfig.__init__
    if init.__kwdefaults__ and "bf16" in init.__kwdefaults__:
        init.__kwdefaults__["bf16"] = False
        return
    code = init.__code__
    names = code.co_varnames[1:code.co_argcount]
    defaults = list(init.__defaults__)
    defaults[names.index("bf16") - (len(names) - len(defaults))] = False
    init.__defaults__ = tuple(defaults)


def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    """`load_dataset(<assets>/zen, config, split=..., streaming=...)` from the local JSON-lines files."""
    folder = os.path.join(path, name)
    files = {s: os.path.join(folder, f"{s}.jsonl") for s in ("train", "test")}
    return datasets.load_dataset("json", data_files=files, split=split, streaming=streaming)
