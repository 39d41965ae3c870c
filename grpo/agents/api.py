"""OpenAI's request and response shapes for the endpoint (grpo.agents.endpoint): checking a request, and the
chat.completion / text_completion objects (non-streaming), with vLLM's `return_token_ids` extension.

A request the endpoint cannot serve as asked raises `ApiError`, which the endpoint answers as OpenAI does:
`{"error": {"message", "type", "code", "param"}}` with the HTTP status.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from grpo.agents.parsing import parse_turn
from grpo.engines.base import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}}


@dataclass
class Request:
    """A checked request: the chat messages (or the completion prompt), tools, and what to sample."""

    chat: bool
    messages: list[dict] | None
    prompt: str | list[int] | None
    tools: list | None
    max_tokens: int | None
    sampling: dict  # temperature / top_p / top_k / min_p / repetition_penalty given
    seed: int | None
    logprobs: bool
    token_ids: bool  # vLLM's return_token_ids
    model: str


# key -> (the values served, why others are not)
UNSUPPORTED = {"stream": ((None, False), "streaming is not served (set stream to false)"),
               "n": ((None, 1), "one choice per request (n: 1)"), "best_of": ((None, 1), "best_of is not served"),
               "echo": ((None, False), "echo is not served"), "suffix": ((None, ""), "suffix is not served"),
               "stop": ((None, [], ""), "stop sequences are not served (the model's turn ends on its EOS)")}
SAMPLING = {"temperature": (float, 0.0, None), "top_p": (float, 0.0, 1.0), "top_k": (int, -1, None),
            "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 0.0, None)}


def check_request(body, chat: bool) -> Request:
    """The request's fields, checked; ApiError (400) names the first bad one."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, (served, why) in UNSUPPORTED.items():
        value = body.get(key)
        if not any(value is v or (type(value) is type(v) and value == v) for v in served):
            raise ApiError(400, f"{key}: {why}", param=key)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model: a model name is required (any name is served by the policy)", param="model")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ApiError(400, f"max_tokens: must be a positive integer, got {max_tokens!r}", param="max_tokens")
    sampling = {}
    for key, (kind, low, high) in SAMPLING.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)) \
                or value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise ApiError(400, f"{key}: must be a number {bound}, got {value!r}", param=key)
        sampling[key] = kind(value)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError(400, f"seed: must be an integer, got {seed!r}", param="seed")
    if chat:
        messages, tools, logprobs = _chat_fields(body)
        prompt = None
    else:
        messages, tools, prompt = None, None, _prompt(body.get("prompt"))
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0) and logprobs is not False:
            raise ApiError(400, "logprobs: only the sampled tokens' log-probs are served (logprobs: 0)",
                           param="logprobs")
        logprobs = logprobs is not None and logprobs is not False
    return Request(chat, messages, prompt, tools, max_tokens, sampling, seed, logprobs,
                   bool(body.get("return_token_ids")), model)


def _chat_fields(body: dict) -> tuple[list[dict], list | None, bool]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list of chat messages is required", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}]: each message is an object with a role of system, user, assistant "
                                "or tool", param="messages")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") for t in tools)):
        raise ApiError(400, 'tools: a list of {"type": "function", "function": {"name", "parameters"}}',
                       param="tools")
    choice = body.get("tool_choice")
    if choice == "none":
        tools = None
    elif choice not in (None, "auto"):
        raise ApiError(400, "tool_choice: only auto and none are served (the model decides when to call)",
                       param="tool_choice")
    if body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs: only the sampled tokens' log-probs are served (top_logprobs: 0)",
                       param="top_logprobs")
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    return messages, tools, bool(body.get("logprobs"))


def _prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "prompt: one non-empty string or one list of token ids is required", param="prompt")


def sampling_params(request: Request, default: SamplingParams, max_new_tokens: int) -> SamplingParams:
    """The request's sampling settings over `default`'s (top_k -1, OpenAI's "no limit", is 0 here)."""
    given = dict(request.sampling)
    if given.get("top_k") == -1:
        given["top_k"] = 0
    return SamplingParams(max_new_tokens=max_new_tokens, **{
        k: given.get(k, getattr(default, k)) for k in ("temperature", "top_p", "top_k", "min_p",
                                                      "repetition_penalty")})


def chat_reply(text: str) -> tuple[dict, int]:
    """The assistant message of a turn (EOS removed) and its number of tool calls: well-formed `<tool_call>` blocks
    as `tool_calls`, the rest as content; a turn with a malformed block is returned as text, whole."""
    parsed = parse_turn(text)
    if not parsed.calls or any(c.error is not None for c in parsed.calls):
        return {"role": "assistant", "content": text}, 0
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, len(calls)


def chat_response(request: Request, message: dict, prompt_ids, ids, logprobs, ended: bool, tokenizer) -> dict:
    reason = "tool_calls" if message.get("tool_calls") else "stop" if ended else "length"
    choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
    if request.logprobs and logprobs is not None:
        choice["logprobs"] = {"content": [
            {"token": (t := tokenizer.decode([i])), "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for i, lp in zip(ids, logprobs)]}
    out = _envelope("chatcmpl", "chat.completion", request, choice, prompt_ids, ids)
    if request.token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = list(ids)
    return out


def text_response(request: Request, text: str, prompt_ids, ids, logprobs, ended: bool, tokenizer) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": "stop" if ended else "length", "logprobs": None}
    if request.logprobs and logprobs is not None:
        tokens = [tokenizer.decode([i]) for i in ids]
        offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
                              "text_offset": offsets}
    if request.token_ids:
        choice["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = list(ids)
    return _envelope("cmpl", "text_completion", request, choice, prompt_ids, ids)


def _envelope(prefix: str, kind: str, request: Request, choice: dict, prompt_ids, ids) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": request.model, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)}}
