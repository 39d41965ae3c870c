"""Multi-turn rollouts on top of any rollout engine: the model calls tools, their answers join its context.

    for each turn, while some rows are live:
        new tokens  <- engine.generate(each live row's ids so far, seeds derived from the row's seed and the turn)
        calls       <- the <tool_call> blocks of the new tokens (grpo.agents.parsing)
        answers     <- each call run (a worker process, or an environment's method), or the error text
        ids         <- ids + the tool messages rendered by the chat template (grpo.agents.template)
    a row stops on a turn without a tool call, on a turn cut by the length budget (truncated), after
    max_tool_calling_iterations rounds of tool calls, or when the tool answers would not fit the budget (truncated:
    they are not appended).

The model's sampled ids are kept verbatim; only the template's text is tokenized. The completion is everything
after the prompt, `model_mask` marks the model's own tokens (1) against the tools' (0), and the loss, the KL and
the importance ratios count the model's tokens only. The length budget (max_completion_length) counts both.
Every turn of a row draws from the row's own seed (`turn_seed`), so a run repeats, and one or several processes
sample the same trajectories.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from grpo.agents.environments import call_with_deadline
from grpo.agents.parsing import parse_turn
from grpo.agents.template import ToolTemplate
from grpo.agents.tools import ERROR_KINDS, ToolSet, as_text, clip
from grpo.engines.base import SamplingParams


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a row's turn: the row's own seed for the first turn (as a single-turn rollout), then a mix."""
    return seed if turn == 0 else (seed * 0x9E3779B1 + turn * 1_000_003) % (2**63 - 1)


@dataclass
class Trajectories:
    """N rows of multi-turn rollouts. Per-token lists are aligned with `ids`."""

    prompts: list  # as given, or with an environment's reset text appended
    prompt_ids: list[list[int]]  # what the first turn was generated from
    ids: list[list[int]]  # the completion: model turns and tool answers (with their template markup), in order
    model_mask: list[list[int]]  # 1 on tokens the model sampled, 0 on the tools' and the template's
    truncated: list[bool]  # cut by the length budget
    logprobs: list[list[float]] | None  # the engine's log-prob on model tokens, 0 elsewhere; None if it gave none
    completions: list  # what reward functions get: the completion as chat messages (assistant, tool, ...)
    stats: list[dict[str, int]]  # per row: turns, calls, and errors by kind (grpo.agents.tools.ERROR_KINDS)
    columns: dict[str, list] = field(default_factory=dict)  # extra keywords for the rewards (environments)
    # more training rows of some rows' episodes (grpo.agents.episodes): (row, prompt_ids, ids, model_mask, logprobs)
    extra_rows: list[tuple] = field(default_factory=list)


@dataclass
class _Row:
    prompt: Any
    prompt_ids: list[int]
    tools: ToolSet
    environment: Any = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    calls: list = field(default_factory=list)  # the last turn's calls
    turns: int = 0
    errors: Counter = field(default_factory=Counter)
    n_calls: int = 0
    truncated: bool = False
    broken: bool = False  # its environment overran a deadline: no more calls on it

    def extend(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class AgentRollout:
    """Multi-turn rollouts of `generator` (a rollout engine: grpo.engines.base) with the tools of `spec`
    (grpo.agents.spec.AgentSpec). `render(prompt, tool_schemas) -> ids` renders a prompt with its tools as the
    run's prompts are rendered; `max_length` is the completion budget in tokens."""

    def __init__(self, spec, generator, tokenizer, render: Callable[[Any, list[dict]], list[int]], max_length: int):
        self.spec, self.generator, self.tokenizer, self.render = spec, generator, tokenizer, render
        self.template = ToolTemplate(tokenizer)
        self.max_length, self.eos = max_length, tokenizer.eos_token_id

    def generate(self, prompts: list, prompt_ids: list[list[int]], columns: dict[str, list],
                 params: SamplingParams, seeds: list[int]) -> Trajectories:
        rows, environments = self._start(prompts, prompt_ids, columns)
        live, turn, logprobs = list(range(len(rows))), 0, True
        limit = self.spec.max_iterations
        while live:
            logprobs &= self._turn([rows[i] for i in live], params, [turn_seed(seeds[i], turn) for i in live])
            callers = [i for i in live if rows[i].calls and not rows[i].truncated and (limit is None or turn < limit)]
            self._answer([rows[i] for i in callers])
            live = [i for i in callers if not rows[i].truncated]
            turn += 1
        stats = [{"turns": r.turns, "calls": r.n_calls, **{k: r.errors[k] for k in ERROR_KINDS}} for r in rows]
        return Trajectories([r.prompt for r in rows], [r.prompt_ids for r in rows], [r.ids for r in rows],
                            [r.mask for r in rows], [r.truncated for r in rows],
                            [r.logprobs for r in rows] if logprobs else None, [r.messages for r in rows], stats,
                            {} if environments is None else {"environments": environments})

    def _start(self, prompts, prompt_ids, columns) -> tuple[list[_Row], list | None]:
        """Each row's tools and environment (reset with the row; its text appended to the prompt)."""
        envs = self.spec.environments
        if envs is None:
            tools = ToolSet(self.spec.tools)
            return [_Row(p, list(ids), tools) for p, ids in zip(prompts, prompt_ids)], None
        names = envs.names(columns, len(prompts))
        instances = envs.take(names)
        rows = []
        for i, (prompt, ids, name, env) in enumerate(zip(prompts, prompt_ids, names, instances)):
            row = {key: values[i] for key, values in columns.items() if not (envs.multi and key == "environment")}
            try:
                observation = env.reset(**{**row, "prompt": prompt})
            except Exception as err:
                raise RuntimeError(f"environment_factory: reset() of {type(env).__name__} raised "
                                   f"{type(err).__name__}: {err} on the row with prompt {str(prompt)[:80]!r}") from err
            tools = ToolSet(self.spec.tools + envs.tools_of(name, env))
            if observation is not None:
                prompt = append_to_prompt(prompt, observation)
                ids = self.render(prompt, tools.schemas)
            rows.append(_Row(prompt, list(ids), tools, env))
        return rows, instances

    def _turn(self, rows: list[_Row], params: SamplingParams, seeds: list[int]) -> bool:
        """One model turn of each row; returns whether the engine gave log-probs."""
        budgets = [self.max_length - len(r.ids) for r in rows]
        out = self.generator.generate([r.prompt_ids + r.ids for r in rows],
                                      dataclasses.replace(params, max_new_tokens=max(budgets)), seeds)
        for k, (row, budget) in enumerate(zip(rows, budgets)):
            new = list(out.ids[k][:budget])
            row.extend(new, True, None if out.logprobs is None else list(out.logprobs[k][:budget]))
            row.turns += 1
            ended = bool(new) and new[-1] == self.eos
            row.truncated = not ended
            parsed = parse_turn(self.tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=False))
            row.calls = parsed.calls
            message = {"role": "assistant", "content": parsed.content}
            if parsed.calls:
                message["tool_calls"] = [c.as_message_call() for c in parsed.calls if c.name is not None]
            row.messages.append(message)
        return out.logprobs is not None

    def _answer(self, rows: list[_Row]) -> None:
        """Run the rows' calls (worker calls together, environment calls one by one) and append the answers."""
        answers = [[None] * len(r.calls) for r in rows]
        in_worker = []
        for k, row in enumerate(rows):
            for j, call in enumerate(row.calls):
                row.n_calls += 1
                problem = row.tools.check(call)
                if problem is not None:
                    answers[k][j] = problem[1]
                    row.errors[problem[0]] += 1
                elif row.tools.tools[call.name].in_process:
                    answers[k][j] = self._in_process(row, call)
                else:
                    in_worker.append((k, j))
        results = self.spec.run_in_workers([(rows[k].calls[j].name, rows[k].calls[j].arguments)
                                            for k, j in in_worker])
        for (k, j), (text, kind) in zip(in_worker, results):
            answers[k][j] = text
            if kind is not None:
                rows[k].errors[kind] += 1
        for row, texts in zip(rows, answers):
            messages = [{"role": "tool", "name": c.name or "unknown", "content": t} for c, t in zip(row.calls, texts)]
            suffix = self.template.suffix_ids(messages)
            if len(row.ids) + len(suffix) >= self.max_length:  # no room for the answers and a next turn
                row.truncated = True
                continue
            row.extend(suffix, False)
            row.messages += messages

    def _in_process(self, row: _Row, call) -> str:
        """An environment method's answer, with the tool deadline; its environment is retired if it overruns."""
        spec = self.spec
        if row.broken:
            row.errors["timeout"] += 1
            return f"Error: {call.name} is unavailable: an earlier call on this environment did not answer in time."
        value, error, timed_out = call_with_deadline(row.tools.tools[call.name].function, call.arguments,
                                                     spec.timeout_s)
        if timed_out:
            row.broken = True
            spec.environments.retire(row.environment)
            row.errors["timeout"] += 1
            return f"Error: the tool {call.name} did not answer within {spec.timeout_s:g} s."
        if error is not None:
            row.errors["raised"] += 1
            return clip(f"Error: {call.name} raised {type(error).__name__}: {error}", spec.max_chars)
        return clip(as_text(value), spec.max_chars)


def append_to_prompt(prompt, text: str):
    """The prompt with `text` appended to its last message (a new list; the dataset's row is not changed)."""
    if isinstance(prompt, str):
        return prompt + text
    last = prompt[-1]
    return list(prompt[:-1]) + [{**last, "content": last["content"] + text}]
