#!/usr/bin/env bash
# The GPU machine's image, simulated on this CPU machine, and bench/gpu_check.py --cpu run in it with no network.
#
#   bash scripts/simulate_gpu_image.sh                 # build (once) and run; JSON lines in .sim-image/gpu_check.jsonl
#   bash scripts/simulate_gpu_image.sh build           # only build the venv and install the carried wheels
#   bash scripts/simulate_gpu_image.sh run [ARGS...]   # only run (ARGS go to gpu_check.py after --cpu)
#   bash scripts/simulate_gpu_image.sh wheels DIR      # only download the wheels a GPU run carries, into DIR
#
# The image (the lent H100/H200 machines, as bench/README.md "On one H200" records it): Python 3.12, torch 2.11.0
# (PyPI's CUDA 13 build, which runs on a CPU), transformers 5.17.0, accelerate 1.15.0, peft 0.21.0, pandas, pyarrow,
# sympy, rich, numpy, xxhash, fsspec and what these depend on; no datasets, trl, vllm, deepspeed, math-verify,
# flash_attn, Pillow or torchvision (whether the image has the last two is not known: nothing above depends on them,
# and transformers 5.17's Qwen2-VL image processor needs both, so they are carried; torchvision 0.26.0 is the build
# for torch 2.11.0). On top,
# exactly the wheels a GPU run carries (CARRIED below; bench/README.md's command downloads them), installed as there:
# `pip install --no-index --no-deps --target SITE` and SITE first on PYTHONPATH.
#
# The network is cut with `unshare -rn` (a new user and network namespace: no interface but a loopback that is down);
# where unshare cannot make namespaces, the run says so and falls back to HTTP(S)_PROXY/ALL_PROXY at a dead address
# (127.0.0.1:9, the discard port), which stops Python's HTTP clients, not raw sockets.
#
# Everything it downloads and builds lies in $SIM_IMAGE_DIR (default .sim-image/ in the checkout, git-ignored):
# about 4 GB, mostly torch's CUDA libraries. Python 3.12 comes from $PYTHON312, else `python3.12`, pyenv or uv.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${SIM_IMAGE_DIR:-$ROOT/.sim-image}
# (xxhash and fsspec: `datasets` imported on the H200 with only the carried wheels, so the image has them)
IMAGE=(torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 peft==0.21.0 pandas pyarrow sympy rich numpy xxhash
       "fsspec<=2026.9.0")
CARRIED=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 math-verify==0.8.0
         latex2sympy2_extended==1.10.2 antlr4-python3-runtime==4.13.2 pillow==13.0.0 torchvision==0.26.0)

find_python312() {
    local candidate
    for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if [[ -n "$candidate" ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null
        then
            command -v "$candidate" || echo "$candidate"
            return
        fi
    done
    if command -v uv >/dev/null && uv python find 3.12 2>/dev/null; then
        return
    fi
    echo "simulate_gpu_image.sh: no Python 3.12 found (tried \$PYTHON312, python3.12, pyenv, uv); set PYTHON312." >&2
    exit 1
}

download_wheels() {  # the wheels a GPU run carries: CPython 3.12 manylinux builds, without their dependencies
    local python=${2:-python3}
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$1" "${CARRIED[@]}"
}

build() {
    local python
    python=$(find_python312)
    if [[ ! -x "$DIR/venv/bin/python" ]]; then
        echo "[sim] venv from $python ($("$python" --version))" >&2
        "$python" -m venv "$DIR/venv"
    fi
    echo "[sim] the image's packages: ${IMAGE[*]}" >&2
    "$DIR/venv/bin/python" -m pip install -q "${IMAGE[@]}"
    rm -rf "$DIR/wheels" "$DIR/site"
    download_wheels "$DIR/wheels" "$DIR/venv/bin/python"
    "$DIR/venv/bin/python" -m pip install -q --no-index --no-deps --target "$DIR/site" "$DIR"/wheels/*.whl
    "$DIR/venv/bin/python" -m pip freeze > "$DIR/image-freeze.txt"
    echo "[sim] built: $DIR/venv ($(wc -l < "$DIR/image-freeze.txt") packages, listed in $DIR/image-freeze.txt)," \
         "carried: $(cd "$DIR/wheels" && ls | tr '\n' ' ')" >&2
}

run() {
    local out="$DIR/gpu_check.jsonl" cut=(unshare -rn)
    if ! unshare -rn true 2>/dev/null; then
        echo "[sim] unshare -rn cannot make a network namespace here: proxies set to a dead address instead" >&2
        cut=(env HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 ALL_PROXY=http://127.0.0.1:9
             http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 NO_PROXY= no_proxy=)
    else
        echo "[sim] network cut with unshare -rn" >&2
    fi
    # A clean environment: no PYTHONPATH of the caller's (it would import another checkout's grpo), one thread.
    cd "$ROOT"
    set +e
    env -i PATH=/usr/bin:/bin HOME="$HOME" LANG=C.UTF-8 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
        PYTHONPATH="$DIR/site:$ROOT" "${cut[@]}" "$DIR/venv/bin/python" bench/gpu_check.py --cpu "$@" \
        > "$out" 2> "$DIR/gpu_check.stderr"
    local rc=$?
    set -e
    echo "[sim] gpu_check.py --cpu exited $rc; JSON lines in $out, its stderr in $DIR/gpu_check.stderr" >&2
    cat "$out"
    return $rc
}

case "${1:-all}" in
    build) build ;;
    run) shift; run "$@" ;;
    wheels) download_wheels "${2:?usage: simulate_gpu_image.sh wheels DIR}" ;;
    all) [[ -d "$DIR/site" ]] || build; run ;;
    *) echo "usage: $0 [all | build | run [ARGS...] | wheels DIR]" >&2; exit 2 ;;
esac
