"""grpo.core must stay pure: torch and the standard library only, no torch.distributed, and a stable public API."""

import ast
import inspect
import json
import pathlib
import re
import subprocess
import sys

import pytest

import grpo.core

CORE_DIR = pathlib.Path(grpo.core.__file__).parent
ALLOWED_TOP_LEVEL = set(sys.stdlib_module_names) | {"torch", "grpo"}


def imported_modules(path):
    """(line, dotted module name) of every import statement in a file, including ones inside functions."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


HEAD_DIR = CORE_DIR.parent / "engines" / "head"


@pytest.mark.parametrize("folder, package, expected", [
    (CORE_DIR, "grpo.core", {"__init__.py", "advantages.py", "loss.py", "importance.py", "surrogates.py"}),
    # The LM head's kernels live beside the engines but are as pure as the formulas: torch and the stdlib only.
    (HEAD_DIR, "grpo.engines.head", {"__init__.py", "logprobs.py", "loss.py", "tiles.py"}),
])
def test_core_files_import_only_torch_and_stdlib(folder, package, expected):
    files = sorted(folder.glob("*.py"))
    assert {f.name for f in files} >= expected
    bad = []
    for path in files:
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top not in ALLOWED_TOP_LEVEL or "distributed" in module.split("."):
                bad.append(f"{path.name}:{line} imports {module}")
            if top == "grpo" and not module.startswith(package):
                bad.append(f"{path.name}:{line} imports {module} from outside {package}")
        tree = ast.parse(path.read_text())
        bad += [f"{path.name}:{node.lineno} uses .distributed" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr == "distributed"]
    assert not bad, bad


def test_core_holds_no_lm_head_kernels():
    # Issue 39: grpo.core is the formulas one checks against the papers; the head's kernels are engine code.
    assert not {"logprobs.py", "head_loss.py", "head_tiles.py"} & {f.name for f in CORE_DIR.glob("*.py")}
    assert not {"hidden_logprobs", "hidden_loss", "token_logprobs", "token_entropy"} & set(grpo.core.__all__)


def test_importing_core_loads_nothing_beyond_torch_and_stdlib():
    # Run in a fresh interpreter: whatever `import grpo.core` adds to sys.modules after `import torch` must be
    # grpo's own modules or the standard library (no transformers, numpy, datasets, yaml, ...).
    script = (
        "import json, sys, torch\n"
        "before = set(sys.modules)\n"
        "import grpo.core\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            cwd=CORE_DIR.parent.parent)
    added = json.loads(result.stdout.strip().splitlines()[-1])
    assert "grpo.core" in added
    foreign = [m for m in added if m.split(".")[0] not in ALLOWED_TOP_LEVEL]
    assert not foreign, foreign


def test_public_api_names_and_parameters():
    # The trainer calls these by keyword; renaming a parameter must be a deliberate, visible change.
    expected = {
        "group_advantages": ["rewards", "scale", "eps", "unbiased"],
        "process_advantages": ["step_rewards", "step_ends", "mask", "group_size", "eps", "unbiased"],
        "mix_advantages": ["outcome", "process", "mask", "outcome_weight", "process_weight"],
        "kl_penalty": ["logp", "ref_logp", "estimator"],
        "policy_loss": ["logp", "old_logp", "advantages", "mask", "settings", "ref_logp", "normalizer", "entropy",
                        "sampling_weights", "sequence_mask", "token_mask"],
        "LossSettings": ["beta", "kl_estimator", "eps_low", "eps_high", "ratio_level", "aggregation", "max_length",
                         "surrogate", "delta", "sapo_temperatures", "vespo_params", "kl_ratio_correction"],
        "aggregation_normalizer": ["aggregation", "step_tokens", "step_rows", "micro_tokens", "micro_batches",
                                   "processes", "rollout_tokens", "steps_per_rollout"],
        "decoupled_advantages": ["rewards", "weights", "eps", "unbiased"],
        "off_policy_mask": ["advantages", "logp", "sampling_logp", "mask", "threshold"],
        "high_entropy_mask": ["entropy", "mask", "threshold"],
        "entropy_bonus": ["entropy", "mask", "coef", "normalizer"],
        "sync_reference_": ["reference", "policy", "alpha"],
        "engine_importance_weights": ["trainer_logp", "engine_logp", "mask", "mode", "clip_max", "clip_min"],
        "token_logprobs": ["logits", "tokens", "temperature", "chunk_size"],
        "token_entropy": ["logits", "chunk_size", "temperature"],
        "hidden_logprobs": ["hidden", "weight", "tokens", "temperature", "chunk_size", "bias", "with_entropy",
                            "vocab_block", "weight_grad_in_place", "kernels", "float32_head"],
    }
    import grpo.engines.head

    for name, params in expected.items():
        package = grpo.engines.head if name in grpo.engines.head.__all__ else grpo.core
        assert name in package.__all__
        assert list(inspect.signature(getattr(package, name)).parameters) == params, name
    defaults = grpo.core.LossSettings()
    assert defaults.kl_estimator == "k3" and defaults.aggregation == "sequence_mean" and defaults.beta == 0.0
    assert inspect.signature(grpo.core.policy_loss).parameters["settings"].default == defaults
    assert inspect.signature(grpo.core.group_advantages).parameters["eps"].default == 1e-4


def test_departures_from_the_paper_are_a_numbered_list():
    doc = grpo.core.__doc__
    assert "depart from the DeepSeekMath paper" in doc
    numbers = [int(n) for n in re.findall(r"^\s+(\d+)\. ", doc, flags=re.MULTILINE)]
    assert len(numbers) >= 5 and numbers == list(range(1, len(numbers) + 1)), numbers
