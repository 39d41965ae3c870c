"""The shipped tool-calling model (grpo/assets/tiny-tools) and the script that builds it."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import load_script
from grpo.agents.template import ToolTemplate
from grpo.tasks import get_task

ASSET = Path(__file__).resolve().parents[1] / "grpo" / "assets" / "tiny-tools"


def test_shipped_checkpoint_is_a_small_chat_model_with_tool_markup():
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True)
    script = load_script("build_tiny_tools_model")
    assert tokenizer.get_vocab() == script.build_tokenizer().get_vocab()
    assert tokenizer.chat_template == script.CHAT_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id != tokenizer.pad_token_id
    assert model.config.tie_word_embeddings and (ASSET / "model.safetensors").stat().st_size < 10 * 2**20
    assert "## Held-out accuracy" in (ASSET / "PROVENANCE.md").read_text()
    ToolTemplate(tokenizer)  # renders tool answers token-exactly
    for tag in script.TAGS + ["<|im_start|>", "<|im_end|>"]:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1


def test_teacher_conversations_train_on_the_teachers_turns_only():
    script = load_script("build_tiny_tools_model")
    tok = script.build_tokenizer()
    template = ToolTemplate(tok)
    row = {"prompt": "What is 482 * 37?", "answer": "17834", "expression": "482 * 37"}
    cfg = script.BuildConfig(p_tool=1.0)
    ids, labels = script.conversation(tok, template, row, random.Random(0), cfg)
    prompt = script.prompt_ids(tok, row["prompt"])
    trained = tok.decode([t for t in labels if t != -100])
    assert ids[:len(prompt)] == prompt and labels[:len(prompt)] == [-100] * len(prompt)
    assert trained == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "482 * 37"}}\n</tool_call>'
                       "<|im_end|><answer>17834</answer><|im_end|>")
    assert "<tool_response>\n17834\n</tool_response>" in tok.decode(ids)  # read, not trained on
    # In its head: right with one-digit operands; with p_head_error 1, one digit off otherwise.
    rng = random.Random(1)
    assert script.head_answer({"expression": "3 * 4", "answer": "12"}, rng, 1.0) == "12"
    wrong = [script.head_answer(row, rng, 1.0) for _ in range(20)]
    assert all(len(w) == 5 and w != "17834" and sum(a != b for a, b in zip(w, "17834")) == 1 for w in wrong)
    assert script.head_answer(row, rng, 0.0) == "17834"


def test_build_script_end_to_end_at_miniature_size_is_deterministic(tmp_path):
    script = load_script("build_tiny_tools_model")
    metrics = script.main(["--out", str(tmp_path / "a"), "--tiny"])
    script.main(["--out", str(tmp_path / "b"), "--tiny"])
    assert set(metrics["greedy"]) == {"accuracy", "tool_call_rate"}
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert "| sampled, temperature 1.0 |" in (tmp_path / "a" / "PROVENANCE.md").read_text()
    assert get_task("calculator").tools == ("calculator",)


def shipped_rollout(generator_of, n: int = 16, params=None):
    """n calculator problems of the test split rolled out with the calculator on the shipped model, through the
    rollout engine `generator_of(model, tokenizer)` makes."""
    from grpo.agents import AgentRollout, AgentSpec
    from grpo.agents.tools import calculator, make_tool
    from grpo.engines.base import SamplingParams

    script = load_script("build_tiny_tools_model")
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True, dtype=torch.float32).eval()
    rows = get_task("calculator").dataset("test", n=n, seed=0)
    spec = AgentSpec([make_tool(calculator)], None, None)
    try:
        rollout = AgentRollout(spec, generator_of(model, tokenizer), tokenizer,
                               lambda p, tools: script.prompt_ids(tokenizer, p), 128)
        ids = [script.prompt_ids(tokenizer, p) for p in rows["prompt"]]
        return rollout.generate(list(rows["prompt"]), ids, {}, params or SamplingParams(128, 1.0),
                                list(range(100, 100 + n))), rows
    finally:
        spec.close()


def test_tool_rollouts_are_the_same_through_our_sampler_and_the_compiled_cpu_engine():
    """The multi-turn loop sits above the engine seam (generate(prompt_ids, params, seeds)): with the same seeds the
    transformers sampler and the CPU engine sample the same conversations, calls, answers and masks."""
    from grpo.engines.select import choose_engine, make_sampler

    made = []

    def engine(name):
        def make(model, tokenizer):
            made.append(make_sampler(choose_engine(name, model, torch.device("cpu"), 1, "NO"), model, tokenizer))
            return made[-1]
        return make

    ours, rows = shipped_rollout(engine("transformers"))
    cpu, _ = shipped_rollout(engine("cpu"))
    assert [type(m).__name__ for m in made] == ["TransformersSampler", "CPUSampler"]
    assert cpu.ids == ours.ids and cpu.model_mask == ours.model_mask and cpu.stats == ours.stats
    assert max(abs(a - b) for x, y in zip(cpu.logprobs, ours.logprobs) for a, b in zip(x, y)) < 1e-4
    calls = [s["calls"] for s in ours.stats]
    assert 0 < sum(c > 0 for c in calls) < len(calls)  # the noisy teacher's mix: some rows call, some do not
    answered = [m for m, s in zip(ours.completions, ours.stats) if s["calls"]]
    assert all(any(m["role"] == "tool" for m in c) for c in answered)  # the calculator's answers are in the context

