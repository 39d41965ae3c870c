"""Multi-turn rollouts with tools (grpo.agents): the call parser, argument checks, tool failures in workers, and
the loop on a scripted model: token ids, the model's mask token by token, the turn limit, the length budget, seeds."""

from __future__ import annotations

import json
import time
from typing import Literal

import pytest
import torch

from conftest import load_script
from grpo.agents import AgentRollout, AgentSpec, turn_seed
from grpo.agents.parsing import ToolCall, parse_turn
from grpo.agents.template import ToolTemplate
from grpo.agents.tools import ToolError, ToolSet, calculator, make_tool, resolve_tool
from grpo.agents.worker import ToolWorkers
from grpo.config import ConfigError
from grpo.engines.base import SamplingParams, ScriptedGenerator


def block(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---- the parser --------------------------------------------------------------------------------------------------
def test_parser_reads_a_valid_call_and_keeps_the_text_around_it():
    turn = parse_turn("Let me compute. " + block("calculator", {"expression": "2 * 3"}) + " Done.")
    assert turn.calls == [ToolCall("calculator", {"expression": "2 * 3"})]
    assert turn.content == "Let me compute.  Done."


def test_parser_reads_several_calls_of_one_turn_in_order():
    turn = parse_turn(block("a", {"x": 1}) + "\n" + block("b", {}) + block("c", {"y": [1, 2]}))
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("a", {"x": 1}, None), ("b", {}, None),
                                                                     ("c", {"y": [1, 2]}, None)]
    assert turn.content == ""


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {', "not valid JSON"),
    ('[1, 2]', "must be a JSON object, got list"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "f", "arguments": [1]}', 'must be a JSON object, got list'),
    ('{"name": "f", "arguments": "not json"}', "a string that is not a JSON object"),
])
def test_parser_returns_malformed_blocks_as_calls_with_an_error(body, error):
    (call,) = parse_turn(f"<tool_call>{body}</tool_call>").calls
    assert call.error is not None and error in call.error


def test_parser_accepts_arguments_written_as_a_json_string_and_reports_an_unclosed_block():
    (call,) = parse_turn('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>').calls
    assert (call.name, call.arguments, call.error) == ("f", {"x": 2}, None)
    turn = parse_turn('ok <tool_call>{"name": "f", "arguments": {}}')
    assert turn.content == "ok" and "not closed" in turn.calls[0].error
    assert parse_turn("no call here").calls == []


# ---- tools and their arguments -----------------------------------------------------------------------------------
def pick(mode: Literal["fast", "slow"], count: int, scale: float = 1.0, flag: bool = False, items: list[int] | None = None) -> str:
    """A tool with every kind of argument.

    Args:
        mode: one of two modes
        count: how many
        scale: a factor
        flag: a switch
        items: some integers
    """
    return f"{mode} {count} {scale} {flag} {items}"



@pytest.mark.parametrize("call, kind, text", [
    (ToolCall(None, error="the tool call is not valid JSON"), "malformed", "not valid JSON"),
    (ToolCall("missing", {}), "unknown_tool", "no tool named 'missing' (tools: calculator, pick)"),
    (ToolCall("calculator", {}), "bad_arguments", "missing required argument 'expression'"),
    (ToolCall("calculator", {"expression": "1", "x": 2}), "bad_arguments", "unexpected argument 'x'"),
    (ToolCall("calculator", {"expression": 5}), "bad_arguments", "'expression' must be string, got int 5"),
    (ToolCall("pick", {"mode": "medium", "count": 1}), "bad_arguments", "must be one of ['fast', 'slow']"),
    (ToolCall("pick", {"mode": "fast", "count": True}), "bad_arguments", "'count' must be integer, got bool"),
    (ToolCall("pick", {"mode": "fast", "count": 1.5}), "bad_arguments", "'count' must be integer, got float"),
    (ToolCall("pick", {"mode": "fast", "count": 1, "items": [1, "a"]}), "bad_arguments", "has an item that"),
])
def test_tool_set_names_what_is_wrong_with_a_call(call, kind, text):
    tools = ToolSet([make_tool(calculator), make_tool(pick)])
    found_kind, message = tools.check(call)
    assert found_kind == kind and text in message, message


def test_tool_set_accepts_calls_that_fit_the_schema():
    tools = ToolSet([make_tool(calculator), make_tool(pick)])
    assert tools.check(ToolCall("pick", {"mode": "slow", "count": 2, "scale": 3, "items": [1, 2]})) is None
    assert tools.check(ToolCall("calculator", {"expression": "2 ** 10"})) is None
    assert calculator("2 ** 10") == "1024" and calculator("1 / 4") == "1/4 = 0.25"


def test_a_tool_must_describe_itself_and_names_must_resolve():
    def undocumented(x):
        return x

    with pytest.raises(ToolError, match="cannot describe 'undocumented'.*type hints"):
        make_tool(undocumented)
    with pytest.raises(ConfigError, match="unknown tool 'calc'; built-in tools are calculator, python"):
        resolve_tool("calc")
    with pytest.raises(ConfigError, match="cannot import 'nowhere:f'"):
        resolve_tool("nowhere:f")
    assert resolve_tool("grpo.agents.tools:calculator").name == "calculator"


# ---- tool failures in worker processes ---------------------------------------------------------------------------
def hangs(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def raises() -> str:
    raise RuntimeError("the disk is full")


def huge() -> str:
    return "x" * 5_000_000


def exits() -> str:
    import os

    os._exit(3)


async def doubled(n: int) -> int:
    return 2 * n


@pytest.fixture(scope="module")
def workers():
    pool = ToolWorkers({"calculator": calculator, "hangs": hangs, "raises": raises, "huge": huge, "exits": exits,
                        "doubled": doubled}, processes=1)
    yield pool
    pool.close()


def test_worker_answers_failures_with_their_text_and_goes_on(workers):
    # processes=1: the calls run one after the other, so every call after the hang needs the replaced worker
    results = workers.run([("calculator", {"expression": "6 * 7"}), ("hangs", {"seconds": 60}), ("raises", {}),
                           ("huge", {}), ("exits", {}), ("doubled", {"n": 21}), ("calculator", {"expression": "1+1"})],
                          timeout_s=1.0, max_chars=100)
    assert results[0] == ("42", None)
    assert results[1] == ("Error: the tool hangs did not answer within 1 s.", "timeout")
    assert results[2] == ("Error: raises raised RuntimeError: the disk is full", "raised")
    assert results[3] == ("x" * 100 + "... [4999900 more characters]", None)
    assert results[4] == ("Error: the tool exits ended its process without answering.", "raised")
    assert results[5:] == [("42", None), ("2", None)]


def test_worker_runs_in_another_process_and_a_killed_keeper_is_replaced(workers):
    import os

    def pid() -> str:
        return str(os.getpid())

    pool = ToolWorkers({"pid": pid}, processes=2)
    try:
        first = pool.run([("pid", {})], timeout_s=5, max_chars=100)[0][0]
        assert first != str(os.getpid())
        os.kill(pool._keeper["pid"], 9)
        assert pool.run([("pid", {})], timeout_s=5, max_chars=100)[0][1] == "raised"  # answered, not hung
        assert pool.run([("pid", {})], timeout_s=5, max_chars=100)[0][1] is None  # a new keeper
    finally:
        pool.close()


def uses_cuda() -> str:
    # torch's error for a CUDA call in a process forked after its parent started CUDA (torch.cuda._lazy_init): what
    # a tool that moves a model to the GPU meets in its worker on a GPU run (the CPU cannot start CUDA to show it)
    raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must "
                       "use the 'spawn' start method")


def test_a_tool_that_needs_cuda_in_its_forked_worker_stops_the_run():
    """Tools run in processes forked from the trainer's; on a GPU run CUDA cannot start there. Such a tool stops the
    run with an error naming it (gpu_review2 N15), instead of answering every call with an error the model reads."""
    pool = ToolWorkers({"uses_cuda": uses_cuda, "calculator": calculator}, processes=1)
    try:
        with pytest.raises(RuntimeError, match="the tool uses_cuda uses CUDA, but tools run in processes forked "
                                               "from the trainer's.*keep tools on the CPU"):
            pool.run([("calculator", {"expression": "1+1"}), ("uses_cuda", {})], timeout_s=5, max_chars=100)
        assert pool.run([("calculator", {"expression": "1+1"})], timeout_s=5, max_chars=100) == [("2", None)]
    finally:
        pool.close()


# ---- the loop on a scripted model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return load_script("build_tiny_tools_model").build_tokenizer()


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def scripted(tok, turns: list[str], seen: list | None = None) -> ScriptedGenerator:
    """A model that says turns[k] (then EOS) in its k-th turn: k is the number of assistant headers in its context
    after the prompt's. `seen` collects (turn, seed) of every call."""
    header = ids_of(tok, "<|im_start|>assistant\n")

    def complete(ids, rng):
        k = sum(ids[i:i + len(header)] == header for i in range(len(ids))) - 1
        if seen is not None:
            seen.append((k, rng.initial_seed()))
        return ids_of(tok, turns[min(k, len(turns) - 1)]) + [tok.eos_token_id]

    return ScriptedGenerator(complete, [tok.eos_token_id])


def rollout(tok, turns, tools=(calculator,), max_iterations=None, max_length=256, seen=None, timeout_s=10.0):
    spec = AgentSpec([make_tool(t) for t in tools], None, None, max_iterations, timeout_s=timeout_s, max_chars=60)
    schemas = spec.schemas({}, 1)[0]

    def render(prompt, tools):
        return ids_of(tok, tok.apply_chat_template([{"role": "user", "content": prompt}], tools=tools,
                                                   tokenize=False, add_generation_prompt=True))

    agent = AgentRollout(spec, scripted(tok, turns, seen), tok, render, max_length)
    return spec, agent, render("What is 6 * 7?", schemas)


def run(agent, prompt_ids, seeds=(5,)):
    return agent.generate(["What is 6 * 7?"] * len(seeds), [prompt_ids] * len(seeds), {}, SamplingParams(256),
                          list(seeds))


def test_loop_appends_tool_answers_token_exactly_and_masks_them(tok):
    call = block("calculator", {"expression": "6 * 7"})
    spec, agent, prompt = rollout(tok, [call, "<answer>42</answer>"])
    try:
        t = run(agent, prompt)
    finally:
        spec.close()
    eos = [tok.eos_token_id]
    first, last = ids_of(tok, call) + eos, ids_of(tok, "<answer>42</answer>") + eos
    answer = ids_of(tok, "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert answer == ToolTemplate(tok).suffix_ids([{"role": "tool", "name": "calculator", "content": "42"}])
    assert t.prompt_ids == [prompt] and t.truncated == [False] and t.logprobs is None
    assert t.ids == [first + answer + last]
    assert t.model_mask == [[1] * len(first) + [0] * len(answer) + [1] * len(last)]
    assert t.completions == [[
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}]},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": "<answer>42</answer>"}]]
    assert t.stats == [{"turns": 2, "calls": 1, "malformed": 0, "unknown_tool": 0, "bad_arguments": 0, "raised": 0,
                        "timeout": 0}]


def test_several_calls_in_one_turn_each_get_an_answer_in_order(tok):
    turn = block("calculator", {"expression": "6 * 7"}) + block("search", {"q": "x"}) + "<tool_call>{oops</tool_call>"
    spec, agent, prompt = rollout(tok, [turn, "<answer>42</answer>"], max_length=600)
    try:
        t = run(agent, prompt)
    finally:
        spec.close()
    tools = [m for m in t.completions[0] if m["role"] == "tool"]
    assert [m["content"][:30] for m in tools] == ["42", "Error: there is no tool named ", "Error: the tool call is not va"]
    assert t.stats[0]["calls"] == 3 and t.stats[0]["unknown_tool"] == 1 and t.stats[0]["malformed"] == 1


@pytest.mark.parametrize("limit, turns", [(0, 1), (1, 2), (3, 4)])
def test_the_turn_limit_counts_rounds_of_tool_calls(tok, limit, turns):
    spec, agent, prompt = rollout(tok, [block("calculator", {"expression": "1 + 1"})], max_iterations=limit,
                                  max_length=600)
    try:
        t = run(agent, prompt)
    finally:
        spec.close()
    assert t.stats[0]["turns"] == turns and t.stats[0]["calls"] == turns - 1
    assert t.truncated == [False]  # it stopped on the limit, each turn ended by EOS
    assert sum(t.model_mask[0]) == turns * 65  # 65 tokens a turn (see the next test)


def test_without_a_limit_the_budget_stops_the_loop_and_marks_the_row_truncated(tok):
    call = block("calculator", {"expression": "1 + 1"})
    spec, agent, prompt = rollout(tok, [call], max_length=260)
    try:
        t = run(agent, prompt)
    finally:
        spec.close()
    # A turn: <tool_call> \n, the 60 characters of the JSON, \n </tool_call> EOS = 65 tokens. The answer "2":
    # \n <|im_start|> "user\n" <tool_response> "\n2\n" </tool_response> <|im_end|> \n <|im_start|> "assistant\n"
    # = 1+1+5+1+3+1+1+1+1+10 = 25 tokens. Three turns and two answers end at 245; the third answer would end at
    # 270, past the budget of 260, so it is not appended and the row is truncated.
    turn, answer = 65, 25
    assert len(ids_of(tok, call)) + 1 == turn
    assert t.stats[0]["turns"] == 3 and len(t.ids[0]) == 3 * turn + 2 * answer
    assert t.truncated == [True] and t.model_mask[0][-turn:] == [1] * turn


def test_every_turn_draws_from_the_rows_own_seed(tok):
    seen = []
    spec, agent, prompt = rollout(tok, [block("calculator", {"expression": "1"}), "<answer>1</answer>"], seen=seen)
    try:
        run(agent, prompt, seeds=(11, 12))
    finally:
        spec.close()
    assert seen == [(0, 11), (0, 12), (1, turn_seed(11, 1)), (1, turn_seed(12, 1))]
    assert turn_seed(11, 0) == 11 and len({turn_seed(11, k) for k in range(50)}) == 50


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def broken(n: int) -> str:
    """Fail.

    Args:
        n: anything
    """
    raise ValueError(f"cannot handle {n}")


def flood() -> str:
    """Print a lot."""
    return "y" * 100_000


def test_tool_failures_reach_the_model_as_answers_and_the_run_goes_on(tok):
    turn = block("slow", {"seconds": 30}) + block("broken", {"n": 3}) + block("flood", {})
    spec, agent, prompt = rollout(tok, [turn, "<answer>1</answer>"], tools=(slow, broken, flood), timeout_s=0.5,
                                  max_length=600)
    try:
        t = run(agent, prompt)
    finally:
        spec.close()
    answers = [m["content"] for m in t.completions[0] if m["role"] == "tool"]
    assert answers == ["Error: the tool slow did not answer within 0.5 s.",
                       "Error: broken raised ValueError: cannot handle 3", "y" * 60 + "... [99940 more characters]"]
    assert t.stats[0]["timeout"] == 1 and t.stats[0]["raised"] == 1 and t.stats[0]["turns"] == 2
    assert t.completions[0][-1]["content"] == "<answer>1</answer>"


def test_a_template_without_tool_messages_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="no chat template"):
        ToolTemplate(plain)
    plain.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content + eos_token }}{% endif %}" \
                          "{% endfor %}"
    with pytest.raises(ConfigError, match="drops tool messages"):
        ToolTemplate(plain)
    plain.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    with pytest.raises(ConfigError, match="does not end an assistant turn with the EOS token"):
        ToolTemplate(plain)


def test_sampled_logprobs_are_kept_for_model_tokens_and_zero_on_tool_tokens(tok):
    class WithLogprobs(ScriptedGenerator):
        def generate(self, prompt_ids, params, seeds):
            out = super().generate(prompt_ids, params, seeds)
            out.logprobs = [[-0.5] * len(r) for r in out.ids]
            return out

    spec, agent, prompt = rollout(tok, [block("calculator", {"expression": "1"}), "<answer>1</answer>"])
    agent.generator = WithLogprobs(agent.generator.complete, [tok.eos_token_id])
    try:
        t = run(agent, prompt)
    finally:
        spec.close()
    assert t.logprobs == [[-0.5 if m else 0.0 for m in t.model_mask[0]]]
    assert torch.tensor(t.model_mask[0]).sum() < len(t.ids[0])
