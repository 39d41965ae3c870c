"""The LLM judge (grpo.rewards.LLMJudge) against vLLM's own OpenAI-compatible server (`vllm serve`, its CPU build)
serving the shipped tiny tools model: its scores are what the model says, greedy, as grpo's sampler says it. Run
in the vLLM environment: `bash scripts/vllm_env.sh`, then `.venv-vllm/bin/python -m pytest -q
tests/test_vllm_judge.py` (the server takes about a minute to start)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except Exception as err:  # noqa: BLE001 - any import failure means: not here
    VLLM_MISSING = f"{type(err).__name__}: {err}"

# The slow tier (CI time: a `vllm serve` start is ~80 s here; tests/test_judges.py runs the judge against grpo's
# endpoint in CI): `.venv-vllm/bin/python -m pytest -q -m slow tests/test_vllm_judge.py`.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    VLLM_MISSING is not None,
    reason=f"vLLM is not importable here ({VLLM_MISSING}); to run these: `bash scripts/vllm_env.sh`, then "
           "`.venv-vllm/bin/python -m pytest -q -m slow tests/test_vllm_judge.py`")]


def test_the_judge_scores_what_vllms_server_says(tmp_path):
    from test_judges import ARITHMETIC, ASSET, greedy_reply
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.engines.sampling import TransformersSampler
    from grpo.rewards import LLMJudge

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    # (gpu_memory_utilization is, on the CPU build, the share of the machine's RAM that must be free at start)
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ASSET),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
                               "512", "--served-model-name", "tiny", "--gpu-memory-utilization", "0.1",
                               "--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20)],
                              stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(2)
        judge = LLMJudge(base_url=f"http://127.0.0.1:{port}/v1", **ARITHMETIC)  # (model "": the one it lists)
        completions = ["3 + 4", "2 * 3", "12 + 30", "9 - 5"]
        scores = judge(prompts=["p"] * 4, completions=completions)
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True)
    engine = TransformersSampler(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    expected = [float(re.findall(r"<answer>(-?\d+)</answer>", greedy_reply(tokenizer, engine, f"What is {c}?"))[-1])
                for c in completions]
    assert judge._served_model == "tiny" and scores == expected
