"""The OpenAI-compatible endpoint (grpo.agents.endpoint) through the real `openai` client: shapes, tool calls,
errors, batching, and the token-exact recording of an episode's calls (grpo.agents.recording)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grpo.agents.endpoint import Endpoint  # noqa: E402
from grpo.agents.recording import assemble  # noqa: E402
from grpo.config import ConfigError  # noqa: E402
from grpo.engines.base import Completions, SamplingParams, ScriptedGenerator  # noqa: E402
from grpo.engines.sampling import TransformersSampler  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "grpo" / "assets" / "tiny-tools"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Exact arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
QUESTION = [{"role": "user", "content": "What is 482 * 37?"}]
# A tool call as the model may write it: compact JSON, which the chat template renders with spaces.
COMPACT_CALL = '<tool_call>\n{"name":"calculator","arguments":{"expression":"482*37"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tiny():
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True)
    return tokenizer, TransformersSampler(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])


def client(url: str, key: str = "unused") -> "openai.OpenAI":
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


def char_by_char(tokenizer, text: str) -> list[int]:
    """`text` as one token per character: ids the model may sample but that tokenizing the text never gives
    (the tool-call tags are single tokens)."""
    return [tokenizer.convert_tokens_to_ids(c) if c != "\n" else tokenizer("\n", add_special_tokens=False)
            ["input_ids"][0] for c in text]


def scripted(tokenizer, turns: list[list[int]]) -> ScriptedGenerator:
    """Says turns[k] (then EOS) as its k-th turn: k counts the tool responses already in its context."""
    response = tokenizer.convert_tokens_to_ids("<tool_response>")
    eos = tokenizer.eos_token_id
    return ScriptedGenerator(lambda ids, rng: turns[min(ids.count(response), len(turns) - 1)] + [eos], [eos])


def test_chat_response_shape_token_ids_and_logprobs_are_the_engines(tiny):
    tokenizer, engine = tiny
    with Endpoint(engine, tokenizer, SamplingParams(48, temperature=1.0)) as endpoint:
        reply = client(endpoint.base_url).chat.completions.create(
            model="tiny-tools", messages=QUESTION, tools=TOOLS, seed=11, logprobs=True, max_tokens=48,
            extra_body={"return_token_ids": True})
        models = client(endpoint.base_url).models.list()
    choice = reply.choices[0]
    prompt = tokenizer(tokenizer.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    direct = engine.generate([prompt], SamplingParams(48, temperature=1.0), [11])  # the same row, the same seed
    assert reply.object == "chat.completion" and reply.model == "tiny-tools" and [m.id for m in models] == ["policy"]
    assert reply.prompt_token_ids == prompt and choice.token_ids == direct.ids[0]
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(direct.ids[0])
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(direct.logprobs[0], abs=0)
    ended = direct.ids[0][-1] == tokenizer.eos_token_id
    text = tokenizer.decode(direct.ids[0][:-1] if ended else direct.ids[0])
    assert choice.finish_reason in (("stop", "tool_calls") if ended else ("length",))
    if choice.message.tool_calls is None:
        assert choice.message.content == text
    else:
        assert text.startswith("<tool_call>") and choice.finish_reason == "tool_calls"


def test_completions_shape_with_token_ids(tiny):
    tokenizer, engine = tiny
    with Endpoint(engine, tokenizer, SamplingParams(8)) as endpoint:
        out = client(endpoint.base_url).completions.create(model="m", prompt="What is 3 + 4?", max_tokens=5, seed=2,
                                                           logprobs=0, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and len(choice.token_ids) <= 5
    assert choice.prompt_token_ids == tokenizer("What is 3 + 4?")["input_ids"]
    assert choice.text == tokenizer.decode(choice.token_ids[:-1] if choice.finish_reason == "stop" else
                                           choice.token_ids)
    assert len(choice.logprobs.token_logprobs) == len(choice.token_ids)
    assert all(x <= 0 for x in choice.logprobs.token_logprobs)


def test_tool_calls_come_back_parsed_and_malformed_ones_as_text():
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    call = tokenizer(COMPACT_CALL, add_special_tokens=False)["input_ids"]
    broken = tokenizer("<tool_call>\n{not json}\n</tool_call>", add_special_tokens=False)["input_ids"]
    with Endpoint(scripted(tokenizer, [call]), tokenizer, SamplingParams(200)) as endpoint:
        reply = client(endpoint.base_url).chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("function", "calculator", {"expression": "482*37"})]
    with Endpoint(scripted(tokenizer, [broken]), tokenizer, SamplingParams(200)) as endpoint:
        reply = client(endpoint.base_url).chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == "<tool_call>\n{not json}\n</tool_call>"


class Failing:
    """An engine whose first call raises."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def generate(self, prompt_ids, params, seeds) -> Completions:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("device lost")
        return self.engine.generate(prompt_ids, params, seeds)


def test_bad_requests_get_openai_errors_and_the_endpoint_goes_on(tiny):
    tokenizer, engine = tiny
    with Endpoint(Failing(engine), tokenizer, SamplingParams(8)) as endpoint:
        c = client(endpoint.base_url)
        with pytest.raises(openai.InternalServerError, match="device lost"):
            c.chat.completions.create(model="m", messages=QUESTION)
        with pytest.raises(openai.BadRequestError, match="streaming is not served") as err:
            c.chat.completions.create(model="m", messages=QUESTION, stream=True)
        assert err.value.body["param"] == "stream" and err.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match="temperature: must be a number at least 0"):
            c.chat.completions.create(model="m", messages=QUESTION, temperature=-1)
        with pytest.raises(openai.BadRequestError, match="messages: a non-empty list"):
            c.chat.completions.create(model="m", messages=[])
        with pytest.raises(openai.BadRequestError, match="tool_choice: only auto and none"):
            c.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="required")
        with pytest.raises(openai.NotFoundError, match="episode e9 is not open"):
            client(endpoint.episode_url("e9")).chat.completions.create(model="m", messages=QUESTION)
        raw = urllib.request.Request(endpoint.base_url + "/chat/completions", data=b"{oops", method="POST")
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(raw)
        assert http.value.code == 400 and "not JSON" in json.loads(http.value.read())["error"]["message"]
        reply = c.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)  # still serving
        assert reply.usage.completion_tokens <= 4 and endpoint.errors == 7


def test_off_localhost_a_token_is_required_and_checked(tiny):
    tokenizer, engine = tiny
    with pytest.raises(ConfigError, match="^endpoint: bound to 0.0.0.0, every request must bear a token"):
        Endpoint(engine, tokenizer, SamplingParams(8), host="0.0.0.0")
    with Endpoint(engine, tokenizer, SamplingParams(8), token="s3cret") as endpoint:
        with pytest.raises(openai.AuthenticationError) as err:
            client(endpoint.base_url, "wrong").chat.completions.create(model="m", messages=QUESTION)
        assert err.value.body["code"] == "invalid_api_key"
        assert client(endpoint.base_url, "s3cret").chat.completions.create(model="m", messages=QUESTION,
                                                                           max_tokens=2).choices


def test_the_endpoint_closes_without_waiting_out_its_servers_poll(tiny, monkeypatch):
    """An endpoint opens and closes at every rollout; closing waits for the serving loop's next look at `shutdown`,
    which http.server makes every 0.5 s by default: 0.25 s of each rollout on average (165 ms measured of a 2.2 s
    rollout). The loop must look every POLL_S (10 ms) and still serve."""
    from grpo.agents import endpoint as module

    polls, serve = [], module._Server.serve_forever
    monkeypatch.setattr(module._Server, "serve_forever",
                        lambda self, poll_interval=0.5: polls.append(poll_interval) or serve(self, poll_interval))
    tokenizer, engine = tiny
    with Endpoint(engine, tokenizer, SamplingParams(8)) as endpoint:
        assert client(endpoint.base_url).chat.completions.create(model="m", messages=QUESTION, max_tokens=2).choices
    assert polls == [0.01]


class Counting:
    def __init__(self, engine):
        self.engine, self.batches = engine, []

    def generate(self, prompt_ids, params, seeds) -> Completions:
        self.batches.append(len(prompt_ids))
        return self.engine.generate(prompt_ids, params, seeds)


def test_requests_arriving_together_are_one_engine_call_and_sample_what_they_would_alone(tiny):
    tokenizer, engine = tiny
    counting = Counting(engine)
    replies = {}
    with Endpoint(counting, tokenizer, SamplingParams(24), window_s=5.0) as endpoint:
        endpoint.waiting = 6  # (as the episode runner sets it: flush once 6 requests wait)

        def ask(seed):
            replies[seed] = client(endpoint.base_url).chat.completions.create(
                model="m", messages=QUESTION, seed=seed, extra_body={"return_token_ids": True}).choices[0].token_ids

        threads = [threading.Thread(target=ask, args=(s,)) for s in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert counting.batches == [6]
    prompt = tokenizer(tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    alone = [engine.generate([prompt], SamplingParams(24), [s]).ids[0] for s in range(6)]
    assert [replies[s] for s in range(6)] == alone


def test_a_batch_waits_while_episodes_make_progress_and_closes_after_a_quiet_window():
    from grpo.agents.endpoint import EngineBatcher

    eos = 0
    engine = Counting(ScriptedGenerator(lambda ids, rng: [5, eos], [eos]))
    batcher = EngineBatcher(engine, window_s=1.0, expected=lambda: 2)
    first = threading.Thread(target=batcher.submit, args=([1], SamplingParams(4), 0))
    first.start()
    for _ in range(6):  # 1.5 s of responses going out (touch) and no request: the window stays open
        time.sleep(0.25)
        batcher.touch()
    batcher.submit([2], SamplingParams(4), 1)
    first.join()
    assert engine.batches == [2]  # (a window from the first request alone would have closed at 1 s: [1, 1])
    lone = threading.Thread(target=batcher.submit, args=([3], SamplingParams(4), 2))
    lone.start()
    lone.join(timeout=60)  # (nothing else comes: the batch goes after a quiet window, short of `expected`)
    batcher.close()
    assert engine.batches == [2, 1]


def test_a_batch_waits_while_the_process_is_busy_building_requests():
    """No request and no response for 3 windows, but this process's CPU busy (episodes' threads building their
    requests on a loaded machine): the batch stays open, and the late request joins it. Without the CPU check the
    window closed after 1 s: [1, 1]. (The spinning thread needs only BUSY_CPU = 10% of a core to count as busy.)"""
    from grpo.agents.endpoint import EngineBatcher

    engine = Counting(ScriptedGenerator(lambda ids, rng: [5, 0], [0]))
    batcher = EngineBatcher(engine, window_s=1.0, expected=lambda: 2)
    first = threading.Thread(target=batcher.submit, args=([1], SamplingParams(4), 0))
    first.start()
    def spin():  # (CPU work in a thread of this process, not its main one; no request, no touch)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            sum(range(1000))

    busy = threading.Thread(target=spin)
    busy.start()
    busy.join()
    batcher.submit([2], SamplingParams(4), 1)
    first.join()
    batcher.close()
    assert engine.batches == [2]


def test_an_episode_ending_closes_the_batch_that_waited_for_it_without_waiting_for_the_window():
    """Two episodes running, one request waiting: when the other episode ends, the batch holds every running
    episode's request and goes to the engine then, not when the quiet window (60 s) ends. (The 30 s bound is half
    the window: without the wake the request waits the whole window.)"""
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    endpoint = Endpoint(ScriptedGenerator(lambda ids, rng: [5, 0], [0]), tokenizer, SamplingParams(4), window_s=60.0)
    with endpoint:
        endpoint.waiting = 2
        answered = threading.Thread(target=endpoint.batcher.submit, args=([1], SamplingParams(4), 0))
        answered.start()
        time.sleep(0.2)  # (the request is in the open batch, which waits for a second one)
        endpoint.episode_ended()
        answered.join(timeout=30)
        assert not answered.is_alive() and endpoint.batcher.engine_calls == 1


def agent_turns(c, tools=TOOLS) -> list:
    """A two-call agent: ask, answer the tool call with 17834, ask again with the whole history."""
    first = c.chat.completions.create(model="m", messages=QUESTION, tools=tools).choices[0].message
    history = QUESTION + [first.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "17834"}]
    second = c.chat.completions.create(model="m", messages=history, tools=tools).choices[0].message
    return [first, second, history]


def test_a_multi_turn_episode_trains_the_ids_sampled_never_the_text_retokenized():
    """The model's first turn is sampled one character per token and with compact JSON: re-rendering the agent's
    history (the template writes the call with single-token tags and spaces) gives other ids. The endpoint gives
    the second call the recorded ids, and the episode's one training row is both calls' sampled ids verbatim."""
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    first_ids = char_by_char(tokenizer, COMPACT_CALL)
    second_ids = tokenizer("<answer>17834</answer>", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    with Endpoint(scripted(tokenizer, [first_ids, second_ids]), tokenizer, SamplingParams(300)) as endpoint:
        key = endpoint.open_episode(seed=5, budget=300)
        first, second, history = agent_turns(client(endpoint.episode_url(key)))
        record = endpoint.close_episode(key)
    assert second.content == "<answer>17834</answer>"
    calls = record.calls
    assert [c.ids for c in calls] == [first_ids + [eos], second_ids + [eos]]
    assert calls[1].base == 0 and calls[1].drift  # the template's rendering differed: the recorded ids were used
    retokenized = tokenizer(tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False,
                                                          add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
    assert calls[1].prompt_ids != retokenized  # re-tokenizing would train other ids than the model sampled
    assert calls[1].prompt_ids[:len(calls[0].prompt_ids) + len(calls[0].ids)] == calls[0].prompt_ids + calls[0].ids
    [row] = assemble(calls)
    assert row.prompt_ids == calls[0].prompt_ids and row.prompt_ids + row.ids == calls[1].prompt_ids + calls[1].ids
    trained = [t for t, m in zip(row.ids, row.mask) if m]
    assert trained == calls[0].ids + calls[1].ids  # exactly the sampled ids, in order
    between = calls[1].prompt_ids[len(calls[0].prompt_ids) + len(calls[0].ids):]
    assert tokenizer.decode(between) == "\n<|im_start|>user\n<tool_response>\n17834\n</tool_response><|im_end|>\n" \
                                        "<|im_start|>assistant\n"
    assert row.mask == [1] * len(calls[0].ids) + [0] * len(between) + [1] * len(calls[1].ids)


def test_calls_that_do_not_extend_the_last_are_rows_of_their_own():
    """An agent that rewrites its history (drops the tool call, asks anew) makes a second chain."""
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    call = tokenizer(COMPACT_CALL, add_special_tokens=False)["input_ids"]
    with Endpoint(scripted(tokenizer, [call]), tokenizer, SamplingParams(200)) as endpoint:
        key = endpoint.open_episode(seed=1, budget=200)
        c = client(endpoint.episode_url(key))
        c.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)
        c.chat.completions.create(model="m", messages=QUESTION + [{"role": "user", "content": "Again."}], tools=TOOLS)
        calls = endpoint.close_episode(key).calls
    rows = assemble(calls)
    assert calls[1].base is None and len(rows) == 2
    assert [(r.prompt_ids, r.ids) for r in rows] == [(c.prompt_ids, c.ids) for c in calls]


def test_an_episode_replays_exactly_from_its_seed(tiny):
    """Seeds come from (episode seed, call index): the same episode seed gives the same calls, token for token."""
    tokenizer, engine = tiny
    calculator = {"482 * 37": "17834"}

    def run(seed):
        with Endpoint(engine, tokenizer, SamplingParams(60, temperature=1.0)) as endpoint:
            key = endpoint.open_episode(seed=seed, budget=200)
            c = client(endpoint.episode_url(key))
            messages = list(QUESTION)
            for _ in range(3):
                message = c.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                expression = json.loads(message.tool_calls[0].function.arguments).get("expression", "")
                messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                 "content": calculator.get(expression, "0")})
            return [(c.prompt_ids, c.ids, c.logprobs) for c in endpoint.close_episode(key).calls]

    runs = {seed: run(seed) for seed in range(4)}
    assert run(2) == runs[2]
    assert len({json.dumps([ids for _, ids, _ in r]) for r in runs.values()}) > 1  # the seed matters


def test_many_clients_at_once_are_all_served():
    """120 connections at once (an asyncio agent's G episodes per prompt): none refused (http.server's default
    listen backlog of 5 refused a third of 200)."""
    import asyncio

    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    with Endpoint(scripted(tokenizer, [[7, 8]]), tokenizer, SamplingParams(16)) as endpoint:
        async def one():
            async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="-", max_retries=0) as c:
                return (await c.chat.completions.create(model="m", messages=QUESTION)).choices[0].message.content

        async def all_of_them():
            return await asyncio.gather(*(one() for _ in range(120)), return_exceptions=True)

        answers = asyncio.run(all_of_them())
    assert answers == [tokenizer.decode([7, 8])] * 120


def test_a_conversation_rendered_again_is_taken_from_the_cache_as_the_template_gave_it(tiny):
    """The G episodes of a prompt send the same first request: the template renders it once (the endpoint keeps
    the last RENDERED renderings); the ids are the template's; a caller changing its copy changes no other; the
    oldest rendering leaves first."""
    from grpo.agents import endpoint as module

    tokenizer, engine = tiny
    endpoint = Endpoint(engine, tokenizer, SamplingParams(8))
    applied = []
    real = tokenizer.apply_chat_template

    class Counting:  # (the tokenizer, its template counted)
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *args, **kwargs):
            return tokenizer(*args, **kwargs)

        def apply_chat_template(self, messages, **kwargs):
            applied.append(len(messages))
            return real(messages, **kwargs)

    endpoint.tokenizer = Counting()
    want = tokenizer(real(QUESTION, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    first = endpoint.render(QUESTION, TOOLS, True)
    first.append(-1)
    assert endpoint.render(QUESTION, TOOLS, True) == want and applied == [1]
    assert endpoint.render(QUESTION, TOOLS, False) != want and applied == [1, 1]  # (another key: rendered)
    for k in range(module.RENDERED):
        endpoint.render([{"role": "user", "content": str(k)}], None, True)
    endpoint.render(QUESTION, TOOLS, True)
    assert len(applied) == 3 + module.RENDERED  # (dropped: rendered again)
