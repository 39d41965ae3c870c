"""A reward model behind a server, in OpenRLHF's `--remote_rm_url` protocol (openrlhf/utils/agent.py, the server
openrlhf/cli/serve_rm.py): each request is a POST of

    {"query": [prompt + response text, ...], "prompts": [prompt text, ...], "labels": [label, ...]}

and the reply a JSON object whose `"rewards"` holds one number per query (OpenRLHF's server also sends `"scores"`,
read by its dynamic filtering, and `"extra_logs"`: {name: numbers}, logged here as `remote_rm/<name>`, their mean).

    reward_funcs: ["http://127.0.0.1:5000/get_reward"]        # a URL is this reward, with its defaults
    reward_funcs: [{name: remote_rm, url: "http://127.0.0.1:5000/get_reward", label_column: answer}]

As OpenRLHF builds them: the prompt's text is the chat template's rendering of a conversational prompt (with
`tokenizer`: the policy's, a path or a shipped name; without one, the messages' contents) or the prompt string; the
query is the prompt's text followed by the completion's tokens decoded with their special tokens (without
`tokenizer`: the completion's text); a label is the row's `label_column` ("" without one, OpenRLHF's default).
Completions go `batch_size` to a request, `concurrency` requests at once, each with `timeout_s` and `retries`
(OpenRLHF's: 180 s, 5 tries). A server that cannot be reached, overruns, or replies out of protocol fails the batch
with `RewardUnavailable` naming the URL, handled as the reward faults are (reward_on_error).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, ClassVar

from .base import ConfigurableReward
from .http import check_url, gather, request_json
from .runner import RewardUnavailable
from .text import completion_text, prompt_text


@dataclasses.dataclass(frozen=True)
class RemoteRewardModel(ConfigurableReward):
    """OpenRLHF's remote reward model; see the module's docstring. `reward_key`: the reply's key read as the
    rewards ("rewards", OpenRLHF's)."""

    name: ClassVar[str] = "remote_rm"

    url: str = ""
    label_column: str | None = None
    tokenizer: str | None = None
    batch_size: int = 64
    concurrency: int = 4
    timeout_s: float = 180.0
    retries: int = 4
    reward_key: str = "rewards"

    def __post_init__(self):
        super().__post_init__()
        check_url(self.name, "url", self.url)
        for key in ("batch_size", "concurrency", "timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{self.name}: setting {key} must be positive, got {getattr(self, key)!r}")
        if self.retries < 0:
            raise ValueError(f"{self.name}: setting retries must be >= 0, got {self.retries!r}")
        object.__setattr__(self, "column_requirements", ((self.label_column,),) if self.label_column else ())
        object.__setattr__(self, "_tokenizer", None)

    def __call__(self, prompts: list, completions: list, completion_ids: list | None = None, log_metric=None,
                 **columns) -> list:
        """(B*G,) prompts and completions in, (B*G,) rewards out (as the server sent them; the runner checks them)."""
        texts = [self.prompt_text(p) for p in prompts]
        ids = completion_ids if completion_ids is not None else [None] * len(completions)
        queries = [t + self.response_text(c, i) for t, c, i in zip(texts, completions, ids, strict=True)]
        labels = list(columns[self.label_column]) if self.label_column else [""] * len(queries)
        spans = [(s, min(s + self.batch_size, len(queries))) for s in range(0, len(queries), self.batch_size)]
        payloads = [{"query": queries[a:b], "prompts": texts[a:b], "labels": [_json_safe(x) for x in labels[a:b]]}
                    for a, b in spans]
        replies = gather(self._post, payloads, self.concurrency)
        rewards: list = []
        logs: dict[str, list[float]] = {}
        for payload, reply in zip(payloads, replies):
            rewards += self._rewards(reply, len(payload["query"]))
            for key, values in (reply.get("extra_logs") or {}).items() if isinstance(reply, dict) else ():
                logs.setdefault(str(key), []).extend(_numbers(values))
        if log_metric is not None:
            for key, values in logs.items():
                if values:
                    log_metric(f"{self.name}/{key}", sum(values) / len(values))
        return rewards

    def prompt_text(self, prompt: Any) -> str:
        tokenizer = self._load_tokenizer()
        if isinstance(prompt, list) and tokenizer is not None and tokenizer.chat_template:
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return prompt_text(prompt)

    def response_text(self, completion: Any, ids: list[int] | None) -> str:
        tokenizer = self._load_tokenizer()
        if tokenizer is not None and ids is not None:
            return tokenizer.decode(list(ids), skip_special_tokens=False)
        return completion_text(completion)

    def _post(self, payload: dict) -> Any:
        return request_json(self.url, payload, timeout_s=self.timeout_s, retries=self.retries, who=self.name)

    def _rewards(self, reply: Any, count: int) -> list:
        values = reply.get(self.reward_key) if isinstance(reply, dict) else None
        if count == 1 and isinstance(values, numbers.Real):
            values = [values]  # (one query: a bare number)
        if not isinstance(values, list) or len(values) != count:
            shown = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise RewardUnavailable(f"{self.name}: {self.url} replied without {count} rewards under "
                                    f"{self.reward_key!r} (got {shown}: {json.dumps(reply, default=str)[:200]})")
        return values

    def _load_tokenizer(self):
        if self.tokenizer is None or self._tokenizer is not None:
            return self._tokenizer
        from transformers import AutoTokenizer

        from grpo.config.base import shipped_model

        object.__setattr__(self, "_tokenizer", AutoTokenizer.from_pretrained(shipped_model(self.tokenizer)))
        return self._tokenizer


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _numbers(values: Any) -> list[float]:
    values = values if isinstance(values, list) else [values]
    return [float(v) for v in values if isinstance(v, numbers.Real) and not isinstance(v, bool)]
