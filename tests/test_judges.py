"""Rewards that ask a server (grpo.rewards.judge, grpo.rewards.remote): an LLM judge against grpo's own endpoint
serving the shipped tiny tools model, OpenRLHF's remote_rm_url protocol against a real HTTP server, their faults
through the reward runner, and both from a config in a training step. Nothing leaves 127.0.0.1."""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.agents.endpoint import Endpoint
from grpo.engines.base import SamplingParams
from grpo.engines.sampling import TransformersSampler
from grpo.rewards import LLMJudge, RemoteRewardModel, RewardError, RewardRunner, RewardUnavailable, resolve_reward

ASSET = Path(__file__).resolve().parents[1] / "grpo" / "assets" / "tiny-tools"
# The tiny tools model answers "What is a + b?" with "<answer>N</answer>": its answer is the judge's score here.
ARITHMETIC = dict(prompt="What is {completion}?", score_pattern=r"<answer>(-?\d+)</answer>", min_score=-1e6,
                  max_score=1e6, normalize=False, max_tokens=24)


@pytest.fixture(scope="module")
def served():
    """(endpoint, tokenizer, engine): grpo's OpenAI-compatible endpoint on the tiny tools model, greedy."""
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True)
    engine = TransformersSampler(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    with Endpoint(engine, tokenizer, SamplingParams(24, temperature=0.0)) as endpoint:
        yield endpoint, tokenizer, engine


def greedy_reply(tokenizer, engine, text: str) -> str:
    """What the model says to `text` as one user message, sampled directly on the engine (no server)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    out = engine.generate([ids], SamplingParams(24, temperature=0.0), [0]).ids[0]
    return tokenizer.decode(out, skip_special_tokens=True)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # (closed on leaving: connections to it are refused)


class Server:
    """A real HTTP server on 127.0.0.1 answering POSTs with `answer(body) -> (status, obj)`; keeps the bodies."""

    def __init__(self, answer):
        self.bodies, self.answer, self.release = [], answer, threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                status, obj = outer.answer(body)
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except BrokenPipeError:  # (the client gave up waiting: the timeout tests)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def rule_rm(body):
    """OpenRLHF's reply shape: 1.0 where the label is in the query; the query lengths as an extra log."""
    rewards = [float(bool(label) and str(label) in q) for q, label in zip(body["query"], body["labels"])]
    return 200, {"rewards": rewards, "scores": rewards, "extra_logs": {"query_chars": [len(q) for q in body["query"]]}}


def test_the_judge_scores_what_the_served_model_says(served):
    endpoint, tokenizer, engine = served
    spec = {"name": "llm_judge", "base_url": endpoint.base_url, **ARITHMETIC}  # (as a config's reward_funcs entry)
    name, judge = resolve_reward(spec)
    completions = ["3 + 4", "2 * 3", "12 + 30", "3 + 4"]  # (a repeat: asked once)
    logged = {}
    scores = judge(prompts=["p"] * 4, completions=completions, log_metric=logged.__setitem__)
    expected = [float(re.findall(r"<answer>(-?\d+)</answer>", greedy_reply(tokenizer, engine, f"What is {c}?"))[-1])
                for c in completions]
    assert name == "llm_judge" and scores == expected and logged == {"llm_judge/requests": 3.0}
    assert judge(prompts=["p"], completions=["2 * 3"], log_metric=logged.__setitem__) == expected[1:2]
    assert logged["llm_judge/requests"] == 0.0  # (the cache: no request)


def test_the_judge_prompt_names_columns_and_normalizes_scores(served):
    endpoint, tokenizer, engine = served
    judge = LLMJudge(base_url=endpoint.base_url, prompt="What is {a} {op} {completion}?",
                     score_pattern=r"<answer>(\d+)</answer>", min_score=0, max_score=40, max_tokens=24)
    runner = RewardRunner([("llm_judge", judge)], on_error="zero")
    with pytest.raises(RewardError, match="needs column 'op'"):
        runner.check_columns(["prompt", "a"])
    said = int(re.findall(r"<answer>(\d+)</answer>", greedy_reply(tokenizer, engine, "What is 2 + 2?"))[-1])
    assert 0 <= said <= 40  # (the model's answer, in range)
    out = runner(["p"], ["2"], [[1]], {"a": [2], "op": ["+"]})
    assert out.per_func["llm_judge"] == [said / 40] and out.errors["llm_judge"] == 0  # ((s - 0) / (40 - 0))


def test_a_reply_without_a_score_is_a_fault_of_its_row(served):
    endpoint, _, _ = served
    judge = LLMJudge(base_url=endpoint.base_url, max_tokens=24)  # (the default rubric: the tiny model writes no
    # "Score: N")
    with pytest.raises(RewardError, match=r"no match of score_pattern .* on row 0"):
        RewardRunner([("llm_judge", judge)])(["p"], ["3 + 4"], [[1]], {})
    out = RewardRunner([("llm_judge", judge)], on_error="zero")(["p", "q"], ["3 + 4", "5"], [[1], [2]], {})
    assert out.per_func["llm_judge"] == [0.0, 0.0] and out.errors["llm_judge"] == 2


def test_a_server_down_refusing_or_hanging_fails_the_batch_naming_the_url(served):
    endpoint, _, _ = served
    down = f"http://127.0.0.1:{closed_port()}/v1"
    judge = LLMJudge(base_url=down, model="m", retries=1, timeout_s=5)
    with pytest.raises(RewardUnavailable, match=re.escape(down) + r".*cannot be reached.*2 tries"):
        judge(prompts=["p"], completions=["c"])
    with pytest.raises(RewardError, match=re.escape(down)):
        RewardRunner([("llm_judge", judge)])(["p"], ["c"], [[1]], {})
    refused = LLMJudge(base_url=endpoint.base_url, temperature=-1.0, retries=3)  # (the server answers 400)
    with pytest.raises(RewardUnavailable, match=r"answered HTTP 400: temperature"):
        refused(prompts=["p"], completions=["c"])
    with Server(lambda body: (server.release.wait(30), (200, {}))[1]) as server:
        hanging = LLMJudge(base_url=server.url + "/v1", model="m", timeout_s=0.5, retries=0, concurrency=1)
        out = RewardRunner([("llm_judge", hanging)], on_error="zero")(["p"] * 3, ["a", "b", "c"], [[1]] * 3, {})
        assert out.per_func["llm_judge"] == [0.0] * 3 and out.errors["llm_judge"] == 3
        assert len(server.bodies) == 1  # (the batch failed at its first request; not re-asked row by row)
        with pytest.raises(RewardUnavailable, match=r"did not answer within 0.5 s \(1 try\)"):
            hanging(prompts=["p"], completions=["d"])


def test_remote_rm_posts_openrlhfs_shape_and_reads_its_rewards():
    with Server(rule_rm) as server:
        name, rm = resolve_reward({"name": server.url + "/get_reward", "label_column": "answer", "batch_size": 2})
        logged = {}
        prompts = ["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?"]
        rewards = rm(prompts=prompts, completions=["2", "5", "6"], completion_ids=[[1], [2], [3]],
                     answer=["2", "4", "6"], log_metric=logged.__setitem__)
        bodies = sorted(server.bodies, key=lambda b: b["prompts"][0])
    assert name == "remote_rm" and rewards == [1.0, 0.0, 1.0]
    assert [sorted(b) for b in bodies] == [["labels", "prompts", "query"]] * 2  # (batches of 2, then 1)
    assert bodies[0] == {"query": ["What is 1 + 1?2", "What is 2 + 2?5"], "prompts": prompts[:2], "labels": ["2", "4"]}
    assert bodies[1] == {"query": ["What is 3 + 3?6"], "prompts": prompts[2:], "labels": ["6"]}
    assert logged == {"remote_rm/query_chars": pytest.approx(15.0)}  # (three queries of 15 characters)


def test_remote_rm_with_a_tokenizer_sends_the_templated_prompt_and_the_decoded_tokens():
    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    prompt = [{"role": "user", "content": "What is 1 + 1?"}]
    ids = tokenizer("<answer>2</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    with Server(rule_rm) as server:
        rm = RemoteRewardModel(url=server.url, tokenizer=str(ASSET))
        assert rm(prompts=[prompt], completions=[[{"role": "assistant", "content": "<answer>2</answer>"}]],
                  completion_ids=[ids]) == [0.0]  # (no label: "")
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert server.bodies == [{"query": [text + "<answer>2</answer><|im_end|>"], "prompts": [text], "labels": [""]}]


def test_remote_rm_faults_are_reward_faults():
    replies = iter([(503, {"error": "busy"}), *[(200, {"rewards": [0.5]})] * 9])
    with Server(lambda body: next(replies)) as server:
        rm = RemoteRewardModel(url=server.url, retries=1)
        assert rm(prompts=["p"], completions=["c"]) == [0.5]  # (a 503, then the answer)
        assert len(server.bodies) == 2
    with Server(lambda body: (200, {"scores": [1.0] * len(body["query"])})) as server:
        rm = RemoteRewardModel(url=server.url, retries=0)
        with pytest.raises(RewardError, match=r"replied without 2 rewards under 'rewards' \(got \['scores'\]"):
            RewardRunner([("remote_rm", rm)])(["p", "q"], ["c", "d"], [[1], [2]], {})
        out = RewardRunner([("remote_rm", rm)], on_error="zero")(["p", "q"], ["c", "d"], [[1], [2]], {})
        assert out.per_func["remote_rm"] == [0.0, 0.0] and out.errors["remote_rm"] == 2
        assert len(server.bodies) == 2  # (one request per batch: not re-run row by row)
    down = f"http://127.0.0.1:{closed_port()}/get_reward"
    with pytest.raises(RewardUnavailable, match=re.escape(down) + ".*cannot be reached"):
        RemoteRewardModel(url=down, retries=0)(prompts=["p"], completions=["c"])
    with pytest.raises(ValueError, match="remote_rm: setting url must be an http"):
        resolve_reward({"name": "remote_rm", "url": "localhost:5000"})


def test_a_recipe_trains_with_a_remote_reward_model_and_a_judge(served, tmp_path):
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.tasks import calculator as calculator_task

    endpoint, _, _ = served
    judge = {"name": "llm_judge", "base_url": endpoint.base_url, "prompt": "{completion}",
             "score_pattern": r"(\d)", "min_score": 0, "max_score": 9}
    with Server(rule_rm) as server:
        args = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=2, prompts_per_step=2,
                          max_completion_length=32, max_steps=1, report_to=[], save_steps=0, log_completions_steps=0,
                          beta=0.0, seed=3, reward_on_error="zero",
                          reward_funcs=[{"name": server.url, "label_column": "answer"}, judge])
        dataset = Dataset.from_list(calculator_task.rows("train", 4, seed=0))
        trainer = GRPOTrainer(model=str(ASSET), args=args, train_dataset=dataset)
        trainer.train()
        labels = [label for body in server.bodies for label in body["labels"]]
    assert trainer.reward_names == ["remote_rm", "llm_judge"]
    assert len(labels) == 4 and set(labels) <= {row["answer"] for row in dataset}  # (the rows' own answers)
    logged = trainer.state.log_history[0]
    assert "rewards/remote_rm/mean" in logged and "rewards/llm_judge/mean" in logged, sorted(logged)
