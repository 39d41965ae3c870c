"""Score a model on held-out prompts: accuracy, format rate, pass@k, maj@k, mean length.

The first reward function is the accuracy one (a sample is correct when it scores at least 1); a reward whose name
contains "format" gives the format rate. pass@k counts a prompt solved when any of its k samples is correct;
maj@k when the most frequent extracted answer among its k samples is a correct one (ties: first seen).
"""

from __future__ import annotations

from collections import Counter

from grpo.training.data.prompts import PromptSet
from grpo.engines.base import SamplingParams
from grpo.rewards.math_accuracy import extract_answer
from grpo.rewards.text import completion_text
from grpo.training.rollout.batch import as_completion, strip_eos


def evaluate_prompts(generator, tokenizer, prompts: PromptSet, rewards, reward_names: list[str],
                     params: SamplingParams, seed: int = 0, k: int = 1,
                     batch_size: int = 256, agent=None) -> dict[str, float | list]:
    """k samples per prompt; returns the metrics and, under "rows", one record per prompt. With `agent` (a
    multi-turn rollout of grpo.agents) the samples are its conversations, scored on the model's own turns, and the
    metrics add tool_call_rate and tool_calls (per sample)."""
    eos = {tokenizer.eos_token_id}
    acc_name = reward_names[0]
    fmt_name = next((n for n in reward_names if "format" in n), None)
    n = len(prompts)
    order = [i for i in range(n) for _ in range(k)]
    correct, formatted, lengths, answers, texts, calls = [], [], [], [], [], []
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        p, ids, cols = prompts.rows(idx)
        seeds = [seed * 1_000_003 + start + r for r in range(len(idx))]
        images = prompts.pixels(idx) if getattr(prompts, "images", None) is not None else None
        if images is not None:  # (each row's pixels with it: grpo.training.data.vision)
            out = generator.generate(ids, params, seeds, images=images)
        elif agent is None:
            out = generator.generate(ids, params, seeds)
        else:
            out = agent.generate(p, ids, cols, params, seeds)
            p, cols, calls = out.prompts, {**cols, **out.columns}, calls + [s["calls"] for s in out.stats]
        stripped = [strip_eos(c, eos) for c in out.ids]
        decoded = tokenizer.batch_decode(stripped, skip_special_tokens=False)
        completions = ([as_completion(q, t) for q, t in zip(p, decoded)] if agent is None or out.completions is None
                       else out.completions)
        scored = rewards(p, completions, out.ids, cols)
        acc = scored.per_func[acc_name]
        correct += [v is not None and v >= 1.0 - 1e-9 for v in acc]
        if fmt_name:
            formatted += [v is not None and v >= 1.0 - 1e-9 for v in scored.per_func[fmt_name]]
        lengths += [len(c) for c in out.ids] if agent is None else [sum(m) for m in out.model_mask]
        answers += [extract_answer(completion_text(c)) for c in completions]
        texts += decoded
    by_prompt = [list(range(i * k, (i + 1) * k)) for i in range(n)]
    pass_k = sum(any(correct[j] for j in js) for js in by_prompt) / n
    maj_k = sum(_majority_correct([answers[j] for j in js], [correct[j] for j in js]) for js in by_prompt) / n
    result: dict[str, float | list] = {
        "accuracy": sum(correct) / len(correct),
        f"pass@{k}": pass_k,
        f"maj@{k}": maj_k,
        "mean_length": sum(lengths) / len(lengths),
        "num_prompts": float(n),
    }
    if fmt_name:
        result["format_rate"] = sum(formatted) / len(formatted)
    if agent is not None:
        result["tool_call_rate"] = sum(c > 0 for c in calls) / len(calls)
        result["tool_calls"] = sum(calls) / len(calls)
    result["rows"] = [{"prompt": prompts.prompts[i], "completions": [texts[j] for j in js],
                       "correct": [correct[j] for j in js]} for i, js in enumerate(by_prompt)]
    return result


def _majority_correct(answers: list[str | None], correct: list[bool]) -> bool:
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = votes.most_common(1)[0][0]
    return correct[answers.index(top)]

