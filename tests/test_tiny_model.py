"""The shipped tiny model (grpo/assets/tiny-arith) and the script that builds it."""

import importlib.util
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "grpo" / "assets" / "tiny-arith"
FORMAT_RE = re.compile(r"^<think>([^<]*(?:<(?!/?think>)[^<]*)*)<\/think>\n<answer>([\s\S]*?)<\/answer>$")


def load_build_script():
    """scripts/ is not a package: import the script by path (registered first, as its dataclass needs)."""
    if "build_tiny_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_tiny_model", ROOT / "scripts" / "build_tiny_model.py")
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["build_tiny_model"]


@pytest.fixture(scope="module")
def shipped():
    # One thread: on a shared 2-core machine, two OpenMP threads per process made generation ~20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True).eval()
    yield tokenizer, model
    torch.set_num_threads(threads)


def complete(model, tokenizer, prompts: list[str], do_sample: bool) -> list[str]:
    """Left-padded batched generation; the completions with EOS and PAD removed."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0} if do_sample else {"do_sample": False}
    with torch.no_grad():
        ids = model.generate(**batch, max_new_tokens=48, **sampling)
    return tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def test_shipped_checkpoint_is_a_small_tied_qwen2(shipped):
    tokenizer, model = shipped
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    assert model.config.tie_word_embeddings
    assert (ASSET / "model.safetensors").stat().st_size < 10 * 2**20
    assert "## Held-out accuracy" in (ASSET / "PROVENANCE.md").read_text()
    assert tokenizer.padding_side == "left" and tokenizer.chat_template is None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id == model.generation_config.eos_token_id


def test_tokenizer_round_trips_and_keeps_tags_as_single_tokens(shipped):
    tokenizer, _ = shipped
    row = get_task("countdown").dataset("test", n=1)[0]
    for text in [row["prompt"] + "<think>" + row["gold_completion"], "  two  spaces\tand a tab, \"q\" ", "héllo ☃"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # no BOS added, no space clean-up
    # <think> 1 </think> \n <answer> 1 </answer>: seven tokens, the tags one each, kept by skip_special_tokens.
    ids = tokenizer("<think>1</think>\n<answer>1</answer>")["input_ids"]
    assert len(ids) == 7
    text = tokenizer.decode(ids + [tokenizer.eos_token_id, tokenizer.pad_token_id], skip_special_tokens=True)
    assert text == "<think>1</think>\n<answer>1</answer>"


def test_shipped_tokenizer_is_what_the_script_builds(shipped):
    tokenizer, _ = shipped
    assert tokenizer.get_vocab() == load_build_script().build_tokenizer().get_vocab()


def test_shipped_model_answers_held_out_problems_in_format(shipped):
    tokenizer, model = shipped
    rows = get_task("arithmetic").dataset("test", n=48, seed=0)
    prompts = [p + "<think>" for p in rows["prompt"]]
    torch.manual_seed(0)
    for do_sample in (False, True):
        completions = complete(model, tokenizer, prompts, do_sample)
        matches = [FORMAT_RE.search("<think>" + c) for c in completions]
        correct = [m is not None and m.group(2).strip() == a for m, a in zip(matches, rows["answer"])]
        # Loose bounds (PROVENANCE.md has the measured rates on 500 problems): most completions are well formed,
        # and some, but not all, sampled ones are right.
        assert sum(m is not None for m in matches) >= 0.5 * len(prompts), completions[:4]
        assert sum(correct) > 0, completions[:4]
        if do_sample:
            assert sum(correct) < len(prompts)


def test_noisy_teacher_errs_at_the_set_rates():
    script = load_build_script()
    rng = random.Random(0)
    row = get_task("arithmetic").dataset("train", n=1, seed=0, min_operands=3, max_operands=3)[0]
    assert script.noisy_completion(row["expression"], rng, 0.0, 0.0) == row["gold_completion"]
    # Every step wrong (each result moved by a nonzero delta): the first step already differs from the gold one.
    noisy = script.noisy_completion(row["expression"], rng, 1.0, 0.0)
    gold_lines, noisy_lines = row["gold_completion"].splitlines(), noisy.splitlines()
    assert gold_lines[0] != noisy_lines[0] and FORMAT_RE.search("<think>" + noisy)
    broken = [script.noisy_completion(row["expression"], rng, 0.0, 1.0) for _ in range(20)]
    assert not any(FORMAT_RE.search("<think>" + b) for b in broken)
    assert all(f"<answer>{row['answer']}</answer>" in b for b in broken)  # the answer is still there


def test_build_script_end_to_end_at_miniature_size_is_deterministic(tmp_path):
    script = load_build_script()
    metrics = script.main(["--out", str(tmp_path / "a"), "--tiny"])
    script.main(["--out", str(tmp_path / "b"), "--tiny"])
    assert set(metrics) >= {"sampled_t1", "greedy"}
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a", local_files_only=True)
    assert model.config.hidden_size == script.TINY["hidden"]
    assert len(complete(model, tokenizer, ["Calculate 1 + 2\n<think>"], do_sample=False)) == 1
    assert "| sampled, temperature 1.0" in (tmp_path / "a" / "PROVENANCE.md").read_text()
