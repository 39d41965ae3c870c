"""Adapt TRL's own GRPO test suite (`tests/test_grpo_trainer.py` of a TRL checkout) into grpo's compatibility suite.

    python scripts/adapt_trl_tests.py --trl-git TRL_GIT_DIR --out tests/trl_suite     # made locally, kept out of git
    python scripts/adapt_trl_tests.py --trl-tests FILE --out /tmp/trl --target trl     # TRL itself: the baseline
    python -m pytest -q -m "slow or not slow" tests/trl_suite                           # the whole suite

TRL's tests are Apache-2.0 (TRL's LICENSE); the adapted file keeps TRL's copyright header, with a line saying where
it comes from and what was changed. What changes, and nothing else:

- `from trl import GRPOConfig, GRPOTrainer` becomes grpo's import (`--target trl` keeps TRL's: the baseline).
- The hub's tiny models `trl-internal-testing/<name>` and the `zen` dataset become local ones, built by
  scripts/build_trl_test_assets.py when the suite is collected (same architectures, heads and columns); `load_dataset`
  of them reads the local files. Nothing is downloaded.
- TRL's `tests/testing_utils.py` helpers (`TrlTestCase`, the `require_*` markers) come from
  tests/trl_suite/trl_suite_utils.py. TRL runs in float32 on a machine without a bf16 GPU (its bf16 default is
  refused there).
- Tests are skipped for one of two reasons only, each with it (tests/trl_suite/conftest.py, SKIPS, and the
  `require_*` markers): they cannot run under TRL either on this machine (vision-language and remote-code models
  that are not built locally, Liger kernels, vLLM, bitsandbytes, a GPU), or they read TRL's private internals by name
  (`_generate`, `_get_per_token_logps_and_entropies`). The same skips apply to both targets, so the two pass counts
  are over the same tests (docs/from_trl.md lists the skips). Every test is in the slow tier but FAST's (the quick
  subset).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tests" / "trl_suite"  # its conftest.py (assets, skips, the slow tier) and trl_suite_utils.py
HEADER = '''# Adapted from TRL's tests/test_grpo_trainer.py ({source}) by grpo's scripts/adapt_trl_tests.py.
# Original: Copyright 2020-2026 The HuggingFace Team, licensed under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0). Changes: the import of GRPOConfig/GRPOTrainer (target: {target}),
# local models and datasets in place of the hub's, TRL's test helpers replaced, skips with reasons.
'''


def adapt(text: str, target: str, source: str) -> str:
    """TRL's test file, adapted (see the module's docstring)."""
    if target == "grpo":
        text = text.replace("from trl import GRPOConfig, GRPOTrainer", "from grpo import GRPOConfig, GRPOTrainer")
    elif not torch_has_bf16_gpu():
        text = text.replace("from trl import GRPOConfig, GRPOTrainer", "from trl import GRPOConfig, GRPOTrainer\n"
                            "from trl_suite_utils import float32_by_default\n\nfloat32_by_default()")
    text = text.replace("from .testing_utils import", "from trl_suite_utils import")
    if target == "grpo":  # (grpo's suite needs no TRL installed)
        text = text.replace("from trl.import_utils import is_liger_kernel_available\n", "")
        text = text.replace("from trl_suite_utils import (",
                            "from trl_suite_utils import (\n    is_liger_kernel_available,")
    # Hub ids -> local paths (every quoted `trl-internal-testing/<name>`), and load_dataset -> the local reader.
    text = re.sub(r'"trl-internal-testing/([^"]+)"', r'os.path.join(ASSETS, "\1")', text)
    text = text.replace("\nif is_peft_available():", "\nfrom trl_suite_utils import ASSETS, load_dataset  # noqa: E402"
                        "\n\nif is_peft_available():", 1)
    return HEADER.format(source=source, target=target) + text


def torch_has_bf16_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def read_source(args) -> tuple[str, str]:
    if args.trl_tests is not None:
        return args.trl_tests.read_text(), str(args.trl_tests)
    rev = subprocess.run(["git", "--git-dir", str(args.trl_git), "rev-parse", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    text = subprocess.run(["git", "--git-dir", str(args.trl_git), "show", f"{rev}:tests/test_grpo_trainer.py"],
                          check=True, capture_output=True, text=True).stdout
    return text, f"huggingface/trl@{rev}"


def write_suite(text: str, source: str, out: Path, target: str) -> Path:
    """The adapted file in `out`; elsewhere than tests/trl_suite, with that folder's conftest.py (pointed at this
    repository, for the asset script) and trl_suite_utils.py beside it."""
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != SUITE.resolve():
        conftest = (SUITE / "conftest.py").read_text()
        line = "REPO = Path(__file__).resolve().parents[2]"
        (out / "conftest.py").write_text(conftest.replace(line, f"REPO = Path({str(REPO)!r})"))
        (out / "trl_suite_utils.py").write_text((SUITE / "trl_suite_utils.py").read_text())
    path = out / "test_grpo_trainer.py"
    path.write_text(adapt(text, target, source))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--trl-tests", type=Path, help="TRL's tests/test_grpo_trainer.py")
    group.add_argument("--trl-git", type=Path, help="a TRL git directory (a bare mirror will do)")
    parser.add_argument("--rev", default="HEAD", help="with --trl-git: the commit or tag")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", choices=("grpo", "trl"), default="grpo")
    args = parser.parse_args()
    text, source = read_source(args)
    print(write_suite(text, source, args.out, args.target))


if __name__ == "__main__":
    main()
