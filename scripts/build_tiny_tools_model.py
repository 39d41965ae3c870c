"""Build `grpo/assets/tiny-tools`: a tiny chat model that sometimes calls a calculator, for the `calculator` task.

    python scripts/build_tiny_tools_model.py --out grpo/assets/tiny-tools    # the shipped checkpoint
    python scripts/build_tiny_tools_model.py --out /tmp/x --tiny              # a miniature end-to-end run, seconds

The method of `build_tiny_model.py` (fixed seeds, `torch.use_deterministic_algorithms(True)`, CPU, float32, one
thread), for a chat model with tools:

1. Tokenizer: one token per byte, as tiny-arith's; `<|im_start|>`, `<|im_end|>` (EOS: the end of a turn, where the
   rollout engine stops) and `<|pad|>` special; `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`,
   `<answer>`, `</answer>` single ordinary tokens. A Qwen2.5-style chat template (CHAT_TEMPLATE below): the tools
   are listed by name in a system turn, a call is a `<tool_call>` block with Qwen2.5's JSON, tool answers come back
   in a user turn inside `<tool_response>`.
2. Data: problems of the `calculator` task's *train* split (1-3 digit operands, one of + - *), each solved by a
   "noisy teacher": with probability `p_tool` it calls `calculator` with the problem's expression and copies the
   answer into `<answer>`; otherwise it answers in its head, right when both operands have one digit and, for
   larger operands, wrong with probability `p_head_error` (one digit changed). A conversation is tokenized as the
   rollout builds it (grpo.agents: the prompt rendered with the tools, the model's turn, the tool answer rendered
   by the template, the next turn); the loss is on the teacher's turns only, end-of-turn tokens included.
3. Model: a `Qwen2ForCausalLM` with tied embeddings, pre-trained from scratch (build_tiny_model's loop).
4. Evaluation through the multi-turn rollout itself (`grpo.agents.AgentRollout` with the calculator run in a
   worker), on the *test* split: sampled at temperature 1.0, and greedy (top-k 1). Accuracy and the fraction of
   completions that call the tool.
5. Writes the checkpoint and PROVENANCE.md with this run's numbers.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).parent))
import build_tiny_model  # noqa: E402
from build_tiny_model import byte_tokenizer, deterministic, make_model, parse_args, write_checkpoint  # noqa: E402

from grpo.agents import AgentRollout, AgentSpec  # noqa: E402
from grpo.agents.template import ToolTemplate  # noqa: E402
from grpo.agents.tools import make_tool, calculator  # noqa: E402
from grpo.engines.base import SamplingParams  # noqa: E402
from grpo.engines.sampling import TransformersSampler  # noqa: E402
from grpo.tasks import get_task  # noqa: E402

EOS, PAD, START = "<|im_end|>", "<|pad|>", "<|im_start|>"
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>"]

CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- 'tools: ' }}{%- for tool in tools %}"
    "{{- tool.function.name if tool.function is defined else tool.name }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass
class BuildConfig(build_tiny_model.ModelSettings):
    """Everything that determines the checkpoint (the model's and its pre-training's settings, then the teacher's
    and the evaluation's); written into PROVENANCE.md."""

    p_tool: float = 0.3  # per problem: the teacher calls the calculator
    p_head_error: float = 0.8  # per problem answered in its head with a multi-digit operand: the answer is wrong
    train_problems: int = 20_000
    eval_n: int = 500
    max_new_tokens: int = 128  # the completion budget in evaluation: model turns and tool answers
    eval_batch_size: int = 250
    threads: int = 1


TINY = dict(hidden=32, layers=1, heads=2, intermediate=64, steps=30, batch_size=16, warmup=5,
            train_problems=200, eval_n=16, eval_batch_size=16)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte; the tags single tokens; <|im_end|> (EOS), <|pad|>, <|im_start|> special."""
    return byte_tokenizer([EOS, PAD, START], TAGS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE)


SCHEMA = make_tool(calculator).schema


def without_unk(path: Path) -> None:
    """Write `unk_token: null` into a saved tokenizer's config: transformers 5 loads a qwen2 model's tokenizer as
    Qwen2Tokenizer, whose default unknown token `<|endoftext|>` would otherwise be added on load as a token the
    model has no row for (a byte-level vocabulary never needs one)."""
    config = Path(path) / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "unk_token": None}, indent=2) + "\n")


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as a run renders it (grpo.training.data.prompts.render_prompt: a user message, the tools' schemas)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=[SCHEMA], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def head_answer(row: dict, rng: random.Random, p_error: float) -> str:
    """The teacher's answer without the tool: right for two one-digit operands, else wrong with probability p_error
    (one digit of the answer replaced by another)."""
    a, _, b = row["expression"].split()
    answer = row["answer"]
    if (len(a) == 1 and len(b) == 1) or rng.random() >= p_error:
        return answer
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    i = rng.choice(digits)
    return answer[:i] + rng.choice([d for d in "0123456789" if d != answer[i]]) + answer[i + 1:]


def conversation(tokenizer, template: ToolTemplate, row: dict, rng: random.Random, cfg: BuildConfig):
    """(token ids, labels) of one teacher conversation: labels are -100 on the prompt and the tool's answer."""
    ids = prompt_ids(tokenizer, row["prompt"])
    labels = [-100] * len(ids)

    def say(text: str) -> None:
        turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.extend(turn)
        labels.extend(turn)

    if rng.random() < cfg.p_tool:
        call = {"name": "calculator", "arguments": {"expression": row["expression"]}}
        say(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        answer = calculator(row["expression"])
        suffix = template.suffix_ids([{"role": "tool", "name": "calculator", "content": answer}])
        ids.extend(suffix)
        labels.extend([-100] * len(suffix))
    else:
        answer = head_answer(row, rng, cfg.p_head_error)
    say(f"<answer>{answer}</answer>")
    return ids, labels


def training_batches(tokenizer, template, rows: list[dict], rng: random.Random, cfg: BuildConfig) -> list[dict]:
    """cfg.batch_size teacher conversations as right-padded batches: one of those that call the tool, one of those
    that do not (each padded to its own longest, so the short ones do not pay for the long ones' padding)."""
    pairs = [conversation(tokenizer, template, rng.choice(rows), rng, cfg) for _ in range(cfg.batch_size)]
    tool = tokenizer.convert_tokens_to_ids("<tool_response>")
    groups = [[p for p in pairs if (tool in p[0]) == calls] for calls in (True, False)]
    return [_padded(tokenizer, group) for group in groups if group]


def _padded(tokenizer, pairs: list[tuple[list[int], list[int]]]) -> dict:
    width = max(len(ids) for ids, _ in pairs)
    input_ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
    labels = torch.full((len(pairs), width), -100)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(pairs):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(ids)] = torch.tensor(lab)
        mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def batch_loss(model, batches: list[dict]) -> torch.Tensor:
    """The mean next-token loss over every labelled token of the batches together."""
    total, count = 0.0, 0
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        total = total + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                          ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    return total / count


def train(model, tokenizer, rows: list[dict], cfg: BuildConfig, log=print) -> list[float]:
    template = ToolTemplate(tokenizer)
    return build_tiny_model.train(
        model, tokenizer, rows, cfg, log, stream="build_tiny_tools_model",
        step_loss=lambda rng: batch_loss(model, training_batches(tokenizer, template, rows, rng, cfg)))


def evaluate(model, tokenizer, cfg: BuildConfig) -> dict:
    """Accuracy and tool-call rate through the multi-turn rollout, sampled (T=1) and greedy (top-k 1)."""
    rows = get_task("calculator").dataset("test", n=cfg.eval_n, seed=cfg.seed, difficulty=cfg.difficulty)
    spec = AgentSpec([make_tool(calculator)], None, None)
    sampler = TransformersSampler(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], cfg.eval_batch_size)
    rollout = AgentRollout(spec, sampler, tokenizer, lambda p, tools: prompt_ids(tokenizer, p), cfg.max_new_tokens)
    ids = [prompt_ids(tokenizer, p) for p in rows["prompt"]]
    seeds = list(range(cfg.seed * 1_000_003, cfg.seed * 1_000_003 + len(ids)))
    out = {}
    try:
        for name, params in (("sampled_t1", SamplingParams(cfg.max_new_tokens, 1.0)),
                             ("greedy", SamplingParams(cfg.max_new_tokens, 1.0, top_k=1))):
            t = rollout.generate(list(rows["prompt"]), ids, {}, params, seeds)
            answers = [_answer(m) for m in t.completions]
            out[name] = {"accuracy": sum(a == g for a, g in zip(answers, rows["answer"])) / len(ids),
                         "tool_call_rate": sum(s["calls"] > 0 for s in t.stats) / len(ids)}
            out[f"{name}_examples"] = [tokenizer.decode(c) for c in t.ids[:4]]
    finally:
        spec.close()
    out["prompts"] = list(rows["prompt"][:4])
    return out


def _answer(messages: list[dict]) -> str | None:
    import re

    found = re.findall(r"<answer>(.*?)</answer>", "".join(m["content"] for m in messages if m["role"] == "assistant"))
    return found[-1].strip() if found else None


def provenance(cfg: BuildConfig, metrics: dict, losses: list[float], n_params: int, seconds: float,
               argv: list[str]) -> str:
    s, g = metrics["sampled_t1"], metrics["greedy"]
    settings = "\n".join(f"| `{k}` | {v} |" for k, v in dataclasses.asdict(cfg).items())
    examples = "\n\n".join(f"```\n{p}\n--- sampled (T=1.0):\n{a}\n--- greedy:\n{b}\n```" for p, a, b in
                           zip(metrics["prompts"], metrics["sampled_t1_examples"], metrics["greedy_examples"]))
    return f"""# tiny-tools: provenance

Built by `python scripts/build_tiny_tools_model.py {' '.join(argv)}` (see that script's docstring for the method).
Nothing was downloaded: the data are generated by `grpo.tasks` and the weights are trained from a random
initialisation, on CPU, with fixed seeds and `torch.use_deterministic_algorithms(True)`.

- Architecture: `Qwen2ForCausalLM`, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, MLP {cfg.intermediate},
  tied embeddings, float32; {n_params:,} parameters.
- Tokenizer: byte-level (one token per byte, no merges) plus {', '.join(f'`{t}`' for t in TAGS)} as single tokens;
  `{EOS}` (EOS), `{PAD}`, `{START}` special; a Qwen2.5-style chat template with tool calls.
- Data: the `calculator` task, difficulty {cfg.difficulty}, {cfg.train_problems:,} rows of the **train** split (seed
  {cfg.seed}); each batch row gets a fresh teacher conversation (calls the tool with probability {cfg.p_tool};
  otherwise answers in its head, wrong with probability {cfg.p_head_error} when an operand has several digits).
- Training: {cfg.steps} steps of batch {cfg.batch_size} (AdamW, peak lr {cfg.lr}, warm-up {cfg.warmup}, cosine to lr/10);
  loss on the teacher's turns only; final loss {losses[-1]:.4f} (mean of the last 100 steps
  {sum(losses[-100:]) / len(losses[-100:]):.4f}).
- Build time: {seconds / 60:.1f} min on {platform.processor() or platform.machine()} with {cfg.threads} thread(s);
  torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}.

## Held-out accuracy

{cfg.eval_n} problems of the **test** split (seed {cfg.seed}, difficulty {cfg.difficulty}), through the multi-turn
rollout (the calculator runs), at most {cfg.max_new_tokens} completion tokens. Correct: the last `<answer>` in the
model's own turns holds the integer answer.

| decoding | accuracy | tool-call rate |
|---|---|---|
| sampled, temperature 1.0 | {s['accuracy']:.3f} | {s['tool_call_rate']:.3f} |
| greedy | {g['accuracy']:.3f} | {g['tool_call_rate']:.3f} |

## Settings

| setting | value |
|---|---|
{settings}

## Examples

{examples}
"""


def build(out: Path, cfg: BuildConfig, argv: list[str], log=print) -> dict:
    start = time.time()
    with deterministic(cfg):
        tokenizer = build_tokenizer()
        rows = get_task("calculator").dataset("train", n=cfg.train_problems, seed=cfg.seed,
                                              difficulty=cfg.difficulty)
        model = make_model(tokenizer, cfg)
        log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {len(rows):,} train problems")
        losses = train(model, tokenizer, rows.to_list(), cfg, log)
        metrics = evaluate(model, tokenizer, cfg)
        log(f"held-out: sampled T=1.0 {metrics['sampled_t1']}  greedy {metrics['greedy']}")
    seconds = time.time() - start
    n_params = sum(p.numel() for p in model.parameters())
    write_checkpoint(out, model, tokenizer, provenance(cfg, metrics, losses, n_params, seconds, argv))
    without_unk(out)
    log(f"wrote {out} in {seconds / 60:.1f} min")
    return metrics


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    out, cfg = parse_args(argv, BuildConfig, TINY, __doc__)
    return build(out, cfg, argv)


if __name__ == "__main__":
    main()
