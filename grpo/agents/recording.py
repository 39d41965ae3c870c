"""Token-exact records of an agent's calls to the endpoint (grpo.agents.endpoint), and the training rows made of them.

Every call of an episode is kept as the endpoint saw it: the prompt's token ids, the ids the engine sampled, their
log-probs. A chat call whose messages are an earlier call's messages, then that call's reply, then more messages
(tool answers, a user turn) *extends* it: its prompt is taken to be the earlier call's prompt ids + the earlier
call's sampled ids + the chat template's rendering of the new messages only. The earlier turns are never
re-tokenized: the template's rendering of the whole conversation is compared with those ids, and where it differs
(the model wrote a tool call's JSON with other spacing, or sampled tokens that re-tokenize differently) the recorded
ids are what the model is given and trained on; the call counts in `drift`.

An episode's calls become training rows (`assemble`): a chain of calls, each extending the one before, is one row
(the first call's prompt, then everything after it, the model's sampled tokens in the loss and the rest masked);
a call that extends no call that ends a chain (the agent rewrote its history, or ran two branches) starts a row of
its own. Each call's sampling seed is `turn_seed(episode seed, call index)`, so an episode that makes the same
calls in the same order replays exactly.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Callable

from grpo.agents.loop import turn_seed


@dataclass
class Call:
    """One call of an episode, token-exact."""

    index: int
    prompt_ids: list[int]
    ids: list[int]  # as sampled, EOS kept where the model stopped
    logprobs: list[float] | None  # the engine's, one per sampled id (None if it gave none)
    ended: bool  # stopped on EOS (else cut by max_tokens or the budget)
    messages: list[dict] | None = None  # the request's messages, normalised (None for /v1/completions)
    tools: list | None = None
    reply: dict | None = None  # the assistant message returned, normalised
    base: int | None = None  # the index of the call this one extends
    drift: bool = False  # the template's rendering of the earlier turns differed from their recorded ids
    tool_calls: int = 0


@dataclass
class Row:
    """One training row of an episode: `ids` is everything after `prompt_ids`; `mask` 1 on sampled tokens."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    truncated: bool = False
    calls: list[int] = field(default_factory=list)


def normal_message(message: dict) -> dict:
    """A chat message as it is compared and rendered: content None as "", tool-call arguments as objects (the
    openai client sends them as JSON strings; chat templates render objects)."""
    out = {k: v for k, v in message.items() if v is not None}
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    out["content"] = content
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_normal_call(c) for c in calls]
    return out


def _normal_call(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # rendered as the string it is
    return {"type": "function", "function": {"name": function.get("name"), "arguments": arguments}}


def same_turn(message: dict, reply: dict) -> bool:
    """Whether an assistant message the agent sent back is the reply the endpoint gave (ids of calls aside)."""
    def key(m):
        return (m.get("role"), (m.get("content") or "").strip(),
                [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []])
    return key(message) == key(reply)


class Episode:
    """The calls of one episode; `budget` caps each chain's completion (tokens after its first prompt)."""

    def __init__(self, key: str, seed: int, budget: int):
        self.key, self.seed, self.budget = key, seed, budget
        self.calls: list[Call] = []
        self.closed = False
        self.lock = threading.Lock()
        self._next = 0

    def next_seed(self) -> tuple[int, int]:
        """The next call's index and sampling seed (calls are numbered as they arrive)."""
        with self.lock:
            index, self._next = self._next, self._next + 1
        return index, turn_seed(self.seed, index)

    def chat_prompt(self, messages: list[dict], tools, render: Callable[[list, object, bool], list[int]],
                    eos: int) -> tuple[list[int], int | None, bool]:
        """The prompt ids of a chat call, the index of the call it extends (or None) and whether the template's
        rendering of the earlier turns differed from the recorded ids. `render(messages, tools, generation_prompt)`
        is the chat template, tokenized."""
        for call in reversed(self.calls):
            n = len(call.messages) if call.messages is not None else -1
            if (n < 0 or not call.ended or call.tools != tools or len(messages) <= n + 1
                    or messages[:n] != call.messages or not same_turn(messages[n], call.reply)):
                continue
            head = render(messages[:n + 1], tools, False)
            ends = [i for i, t in enumerate(head) if t == eos]
            full = render(messages, tools, True)
            if not ends or full[:ends[-1] + 1] != head[:ends[-1] + 1]:
                continue  # the template renders the earlier turns differently once more follow: not appendable
            recorded = call.prompt_ids + call.ids + full[ends[-1] + 1:]
            return recorded, call.index, recorded != full
        return render(messages, tools, True), None, False

    def room(self, prompt_ids: list[int], base: int | None) -> int:
        """Tokens the call may sample within its chain's budget."""
        if base is None:
            return self.budget
        first = self.calls[self._position(base)]
        while first.base is not None:
            first = self.calls[self._position(first.base)]
        return self.budget - (len(prompt_ids) - len(first.prompt_ids))

    def _position(self, index: int) -> int:
        return next(i for i, c in enumerate(self.calls) if c.index == index)

    def add(self, call: Call) -> None:
        with self.lock:
            self.calls.append(call)


def assemble(calls: list[Call]) -> list[Row]:
    """The training rows of an episode's calls, in the order their chains started (see the module's docstring)."""
    rows: list[Row] = []
    ends: dict[int, Row] = {}  # the index of a chain's last call -> its row
    for call in sorted(calls, key=lambda c: c.index):
        row = ends.pop(call.base, None) if call.base is not None else None
        if row is None:
            row = Row(list(call.prompt_ids))
            rows.append(row)
        else:
            done = len(row.prompt_ids) + len(row.ids)
            between = call.prompt_ids[done:]  # the template's and the tools' tokens since the last call
            row.ids += between
            row.mask += [0] * len(between)
            row.logprobs += [0.0] * len(between)
        row.ids += call.ids
        row.mask += [1] * len(call.ids)
        row.logprobs += call.logprobs if call.logprobs is not None else [0.0] * len(call.ids)
        row.truncated = not call.ended
        row.calls.append(call.index)
        ends[call.index] = row
    return rows


def select_extra_rows(extra: list[tuple], rows: list[int]) -> list[tuple]:
    """Episodes' extra rows (row, ...) of the rows `rows` kept, renumbered: row r becomes its place in `rows`."""
    where = {r: k for k, r in enumerate(rows)}
    return [(where[e[0]], *e[1:]) for e in extra if e[0] in where]


def concat_extra_rows(parts: list[list[tuple] | None], sizes: list[int]) -> list[tuple]:
    """Extra rows of batches of `sizes` rows joined in order: each part's row numbers offset by those before."""
    out, start = [], 0
    for part, size in zip(parts, sizes):
        out += [(e[0] + start, *e[1:]) for e in part or []]
        start += size
    return out
