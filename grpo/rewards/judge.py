"""An LLM as judge: a reward that asks a model behind an OpenAI-compatible server (`grpo`'s endpoint, vLLM, any
`/v1/chat/completions`) to grade each completion, and reads the score from its reply.

    judge = LLMJudge(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen2.5-7B-Instruct")
    reward_funcs: [{name: llm_judge, base_url: "http://127.0.0.1:8000/v1", prompt: "...{prompt}...{completion}..."}]

Each completion's judge prompt is `prompt` (a `str.format` template) filled with `{prompt}` (the prompt's text: its
messages' contents), `{completion}` (the completion's text: its assistant messages) and any dataset column by name
(`{answer}`: then the column is required, checked before training). The reply's score is the last match of
`score_pattern` (its first group, a number; `float()` of it, nothing is evaluated), which must lie in [min_score,
max_score]; the reward is it mapped onto [0, 1] (`normalize`, default) or as read.

Requests run `concurrency` at a time, each with `timeout_s` and `retries` (grpo.rewards.http); identical judge prompts
in a batch are asked once, and replies are cached by judge prompt (`cache_size`, least recently used dropped). A
server that cannot be reached, overruns, or refuses the request fails the batch (`RewardUnavailable`, naming the URL);
a reply without a score in range fails its row (`ValueError`, naming it). Both go through the runner's fault handling:
`reward_on_error: raise` stops the run with the message, `zero` scores them 0 and counts them
(`reward/errors/llm_judge`, the reward_errors alarm). The key is read from the environment variable `api_key_env`, so
that it is never written into a run's config.yaml.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import string
import threading
from typing import Any, ClassVar

from .base import ConfigurableReward
from .http import check_url, gather, request_json
from .runner import RewardUnavailable
from .text import completion_text, prompt_text

DEFAULT_PROMPT = (
    "Grade the response to the task below from 0 to 10: 10 if it is fully correct and complete, 0 if it is wrong or "
    "off-topic.\n\nTask:\n{prompt}\n\nResponse:\n{completion}\n\nExplain briefly, then end with a line 'Score: N'."
)


@dataclasses.dataclass(frozen=True)
class LLMJudge(ConfigurableReward):
    """The judge reward; see the module's docstring. `base_url` ends in /v1 (the openai client's base_url); `model`
    "" asks the server's /models for its first; `system`: an optional system message; `seed`: sent with each request
    (a server that honours it answers the same prompt alike); `max_tokens`, `temperature`: the judge's sampling."""

    name: ClassVar[str] = "llm_judge"

    base_url: str = ""
    model: str = ""
    prompt: str = DEFAULT_PROMPT
    system: str | None = None
    score_pattern: str = r"[Ss]core\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
    min_score: float = 0.0
    max_score: float = 10.0
    normalize: bool = True
    max_tokens: int = 512
    temperature: float = 0.0
    seed: int | None = 0
    api_key_env: str | None = None
    timeout_s: float = 60.0
    retries: int = 2
    concurrency: int = 8
    cache_size: int = 4096

    def __post_init__(self):
        super().__post_init__()
        check_url(self.name, "base_url", self.base_url)
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as err:
            raise ValueError(f"{self.name}: score_pattern {self.score_pattern!r} is not a regular expression: {err}")
        if pattern.groups < 1:
            raise ValueError(f"{self.name}: score_pattern needs a group around the number, e.g. 'Score: (\\d+)'")
        if not self.min_score < self.max_score:
            raise ValueError(f"{self.name}: min_score ({self.min_score}) must be below max_score ({self.max_score})")
        for key in ("timeout_s", "concurrency", "max_tokens"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{self.name}: setting {key} must be positive, got {getattr(self, key)!r}")
        if self.retries < 0 or self.cache_size < 0:
            raise ValueError(f"{self.name}: retries and cache_size must be >= 0")
        columns = _template_columns(self.name, self.prompt)
        object.__setattr__(self, "column_requirements", tuple((column,) for column in columns))
        object.__setattr__(self, "_columns", columns)
        object.__setattr__(self, "_pattern", pattern)
        object.__setattr__(self, "_cache", collections.OrderedDict())
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_served_model", self.model or None)

    def __call__(self, prompts: list, completions: list, log_metric=None, **columns) -> list[float]:
        """(B*G,) prompts and completions in, (B*G,) scores out."""
        asks = [self.judge_prompt(p, c, {k: columns[k][i] for k in self._columns})
                for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
        replies = self.replies(asks, log_metric)
        scores, bad = [], []
        for row, ask in enumerate(asks):
            try:
                scores.append(self.score(replies[ask]))
            except ValueError as err:
                bad.append((row, err))
        if bad:
            row, err = bad[0]
            raise err if len(asks) == 1 else ValueError(f"{len(bad)} of {len(asks)} judge replies hold no score; "
                                                        f"row {row}: {err}")
        return scores

    def judge_prompt(self, prompt: Any, completion: Any, values: dict[str, Any]) -> str:
        """The text the judge is asked for one completion."""
        return self.prompt.format(prompt=prompt_text(prompt), completion=completion_text(completion),
                                  **{k: v for k, v in values.items() if k not in ("prompt", "completion")})

    def replies(self, asks: list[str], log_metric=None) -> dict[str, str]:
        """The judge's reply to each distinct text of `asks`: cached ones, the rest asked `concurrency` at a time."""
        with self._lock:
            known = {a: self._cache[a] for a in dict.fromkeys(asks) if a in self._cache}
            for ask in known:
                self._cache.move_to_end(ask)
        missing = [a for a in dict.fromkeys(asks) if a not in known]
        model = self._model() if missing else None
        fresh = dict(zip(missing, gather(lambda ask: self._ask(model, ask), missing, self.concurrency)))
        with self._lock:
            for ask, reply in fresh.items():
                self._cache[ask] = reply
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if log_metric is not None:
            log_metric(f"{self.name}/requests", float(len(missing)))
        return {**known, **fresh}

    def score(self, reply: str) -> float:
        """The reward a reply gives: its last `score_pattern` match, in [min_score, max_score], normalized."""
        matches = self._pattern.findall(reply)
        if not matches:
            raise ValueError(f"no match of score_pattern {self.score_pattern!r} in the reply {_excerpt(reply)}")
        last = matches[-1]
        text = last[0] if isinstance(last, tuple) else last
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"the score {text!r} is not a number (reply {_excerpt(reply)})") from None
        if not (math.isfinite(value) and self.min_score <= value <= self.max_score):
            raise ValueError(f"the score {value:g} is outside [{self.min_score:g}, {self.max_score:g}] (reply "
                             f"{_excerpt(reply)})")
        return (value - self.min_score) / (self.max_score - self.min_score) if self.normalize else value

    def _ask(self, model: str, ask: str) -> str:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": ask}]
        body = {"model": model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, **({"seed": self.seed} if self.seed is not None else {})}
        reply = request_json(f"{self.base_url.rstrip('/')}/chat/completions", body, timeout_s=self.timeout_s,
                             retries=self.retries, who=self.name, headers=self._headers())
        try:
            content = reply["choices"][0]["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RewardUnavailable(f"{self.name}: {self.base_url} replied without choices[0].message: "
                                    f"{str(reply)[:200]}") from None
        return content or ""

    def _model(self) -> str:
        """The model to ask: `model`, else the first the server lists (asked once)."""
        if self._served_model is None:
            listing = request_json(f"{self.base_url.rstrip('/')}/models", None, timeout_s=self.timeout_s,
                                   retries=self.retries, who=self.name, headers=self._headers())
            try:
                object.__setattr__(self, "_served_model", str(listing["data"][0]["id"]))
            except (KeyError, IndexError, TypeError):
                    raise RewardUnavailable(f"{self.name}: {self.base_url}/models lists no model; set model") from None
        return self._served_model

    def _headers(self) -> dict[str, str]:
        if not self.api_key_env:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"{self.name}: api_key_env names {self.api_key_env}, which is not set in the environment")
        return {"Authorization": f"Bearer {key}"}


def _template_columns(who: str, template: str) -> tuple[str, ...]:
    """The dataset columns a judge prompt names (besides {prompt} and {completion}); `ValueError` for a field that
    is not a plain name."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as err:
        raise ValueError(f"{who}: prompt is not a valid template ({err}); write a literal brace as {{{{ or }}}}")
    bad = [field for field in fields if not field.isidentifier()]
    if bad:
        raise ValueError(f"{who}: prompt's fields must be plain names ({{prompt}}, {{completion}}, {{a_column}}), "
                         f"got {{{bad[0]}}}")
    if "completion" not in fields:
        raise ValueError(f"{who}: prompt must show the judge the completion: put {{completion}} in it")
    return tuple(dict.fromkeys(f for f in fields if f not in ("prompt", "completion")))


def _excerpt(reply: str) -> str:
    return repr(reply[:120] + ("..." if len(reply) > 120 else ""))
