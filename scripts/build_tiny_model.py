"""Build `grpo/assets/tiny-arith`: the tiny model that `grpo train`'s default job starts from.

    python scripts/build_tiny_model.py --out grpo/assets/tiny-arith          # the shipped checkpoint
    python scripts/build_tiny_model.py --out /tmp/x --tiny                     # a miniature end-to-end run, seconds

What it does, deterministically (fixed seeds, `torch.use_deterministic_algorithms(True)`, CPU, float32):

1. Tokenizer: one token per byte (the byte-level alphabet of GPT-2, no merges), so every string round-trips exactly
   and ASCII text is one token per character; plus `<think>`, `</think>`, `<answer>`, `</answer>` as single
   ordinary tokens (not "special", so decoding with `skip_special_tokens=True` keeps them) and the special tokens
   `<|endoftext|>` (EOS), `<|pad|>` and `<|bos|>` (never added automatically). No chat template.
2. Data: problems of the `arithmetic` task's *train* split (default difficulty 2: 2-3 operands in 1..9), each
   written out by a "noisy teacher": the worked solution of `grpo.tasks.arithmetic.solve`, except that each step's
   result is off by one of +-1, +-2, +-10 with probability `p_step_error` (the wrong value is then used by the
   later steps, so the answer is wrong too), and a fraction `p_format_error` of solutions has a broken format
   (no `</think>`, or no newline before `<answer>`). The text trained on is `prompt + "<think>" + completion + EOS`,
   with the loss on the completion and EOS only.
3. Model: a `Qwen2ForCausalLM` with tied embeddings, pre-trained from scratch by a plain AdamW loop.
4. Evaluation on the held-out *test* split: sampled at temperature 1.0 (no top-k, no top-p) and greedy. Because
   the teacher errs, sampling at temperature 1.0 reproduces roughly the teacher's error rate, which leaves GRPO
   room to improve; greedy decoding, which picks the most likely (usually the correct) step, scores higher.
5. Writes the checkpoint (config.json, model.safetensors, generation_config.json, tokenizer files) and
   PROVENANCE.md with the data, seeds, sizes, steps, accuracies and build time of this run.

An answer is correct when the text inside the last <answer>...</answer> is the integer answer; the format is that
of the tutorial seed's format reward (the regex `FORMAT_RE` below, applied to "<think>" + completion).

The shipped checkpoint is this script's defaults (seed 0): 4 layers, hidden 128, 1,084,928 parameters (4.3 MB),
1,500 steps of 64 solutions, teacher step error 0.35 and format error 0.1, one CPU thread, 12-16 minutes on a
2-core machine. Measured at build time on 500 held-out problems (PROVENANCE.md has this run's exact numbers):
sampled at temperature 1.0, accuracy 0.344 and format rate 0.896; greedy, accuracy 0.742 and format rate 1.0.
How the teacher's step error rate moved those numbers (sampled / greedy accuracy, same settings otherwise):
0.30 -> 0.544 / 0.896; 0.35 -> 0.344 / 0.742; 0.40 -> 0.300 / 0.718.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from grpo.tasks import get_task
from grpo.tasks.arithmetic import completion_text, parse_expression, solve

EOS, PAD, BOS = "<|endoftext|>", "<|pad|>", "<|bos|>"
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
PREFILL = "<think>"
# The format reward of the tutorial seed (000), applied to "<think>" + completion.
FORMAT_RE = re.compile(r"^<think>([^<]*(?:<(?!/?think>)[^<]*)*)<\/think>\n<answer>([\s\S]*?)<\/answer>$")
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The noisy teacher's mistakes: a slip of one or two units, or a carry error of ten.
ERROR_DELTAS = (-10, -2, -1, 1, 2, 10)
# The noisy teacher's format mistakes: drop "</think>", or drop the newline before "<answer>".
FORMAT_BREAKS = (("</think>\n", ""), ("</think>\n<answer>", "</think><answer>"))


@dataclasses.dataclass
class ModelSettings:
    """The model and its pre-training, shared by the tiny models' builds (build_tiny_tools_model.py too)."""

    seed: int = 0
    difficulty: int = 2  # of the task
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 512
    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100  # linear warm-up steps, then cosine decay to lr / 10
    weight_decay: float = 0.01


@dataclasses.dataclass
class BuildConfig(ModelSettings):
    """Everything that determines the checkpoint; written into PROVENANCE.md."""

    p_step_error: float = 0.35  # per reasoning step: the teacher writes a wrong result
    p_format_error: float = 0.1  # per solution: the teacher breaks the format
    train_problems: int = 20_000  # rows drawn from the train split; batches sample from them
    eval_n: int = 500  # held-out problems scored at the end
    max_new_tokens: int = 48
    eval_batch_size: int = 250
    threads: int = 1  # CPU threads; one makes float reductions, hence the weights, independent of the machine's cores


# A miniature build for tests: the same code path end to end in a few seconds.
TINY = dict(hidden=32, layers=1, heads=2, intermediate=64, steps=30, batch_size=16, warmup=5,
            train_problems=200, eval_n=16, max_new_tokens=24, eval_batch_size=16)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte; the four tags as single tokens; EOS/PAD/BOS special. Vocab: 263."""
    return byte_tokenizer([EOS, PAD, BOS], TAGS, eos_token=EOS, pad_token=PAD, bos_token=BOS)


def byte_tokenizer(special: list[str], tags: list[str], **settings) -> PreTrainedTokenizerFast:
    """Ids: the special tokens, the tags (ordinary single tokens), then one per byte; `settings` name the special
    tokens' roles (eos_token=...) and may add a chat_template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*special, *tags, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text is mapped to bytes as is, so decode(encode(s)) == s.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left", clean_up_tokenization_spaces=False,
                                   model_max_length=512, **settings)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # transformers 5 writes its own class name, which 4.x cannot load; the generic fast class loads in both.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def noisy_completion(expression: str, rng: random.Random, p_step: float, p_format: float) -> str:
    """A teacher's completion for `expression`: each step wrong with probability p_step, format broken w.p. p_format."""

    def perturb(c: int) -> int:
        return c + rng.choice(ERROR_DELTAS) if rng.random() < p_step else c

    steps, value = solve(parse_expression(expression), perturb)
    text = completion_text(steps, value)
    if rng.random() < p_format:
        old, new = rng.choice(FORMAT_BREAKS)
        text = text.replace(old, new)
    return text


def training_batch(tokenizer, rows: list[dict], rng: random.Random, cfg: BuildConfig) -> dict[str, torch.Tensor]:
    """A right-padded batch of teacher solutions: input_ids, attention_mask (B, L) and labels (B, L), -100 on
    the prompt, the prefill and the padding."""
    prompts, texts = [], []
    for _ in range(cfg.batch_size):
        row = rng.choice(rows)
        prompts.append(row["prompt"] + PREFILL)
        texts.append(noisy_completion(row["expression"], rng, cfg.p_step_error, cfg.p_format_error))
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    seqs = [p + c + [tokenizer.eos_token_id] for p, c in zip(prompt_ids, completion_ids)]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (seq, p) in enumerate(zip(seqs, prompt_ids)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(seq[len(p) :])
        mask[i, : len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def make_model(tokenizer, cfg: BuildConfig) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def lr_at(step: int, cfg: BuildConfig) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup steps, then cosine decay to cfg.lr / 10 at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, tokenizer, rows: list[dict], cfg: BuildConfig, log=print, step_loss=None,
          stream: str = "build_tiny_model") -> list[float]:
    """Supervised pre-training on noisy-teacher solutions; returns the loss of every step. `step_loss(rng)`: one
    step's loss on a fresh batch (default: the arithmetic teacher's); `stream` names the data's random stream."""
    rng = random.Random(f"{stream}/data/{cfg.seed}")
    step_loss = step_loss or (lambda rng: model(**training_batch(tokenizer, rows, rng, cfg)).loss)
    # Weight decay on matrices only (embeddings and linear layers), not on norms, as is usual for transformers.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98),
    )
    model.train()
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = step_loss(rng)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 100 == 0 or step == cfg.steps - 1:
            log(f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, cfg):.2e}")
    model.eval()
    return losses


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], do_sample: bool, cfg: BuildConfig) -> list[str]:
    """Completions of `prompts` (each already ending in the prefill), left-padded batches, EOS and PAD removed."""
    out = []
    for start in range(0, len(prompts), cfg.eval_batch_size):
        batch = tokenizer(prompts[start : start + cfg.eval_batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        ids = model.generate(**batch, max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **sampling)
        out += tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def score(completions: list[str], answers: list[str]) -> dict[str, float]:
    """accuracy: the last <answer> holds the integer answer; format_rate: "<think>" + completion matches FORMAT_RE."""
    correct = formatted = 0
    for completion, answer in zip(completions, answers):
        found = ANSWER_RE.findall(completion)
        correct += bool(found) and found[-1].strip() == answer
        formatted += FORMAT_RE.search(PREFILL + completion) is not None
    return {"accuracy": correct / len(answers), "format_rate": formatted / len(answers)}


def evaluate(model, tokenizer, cfg: BuildConfig) -> dict:
    """Scores on cfg.eval_n held-out problems, sampled (temperature 1.0) and greedy, plus a few examples."""
    rows = get_task("arithmetic").dataset("test", n=cfg.eval_n, seed=cfg.seed, difficulty=cfg.difficulty)
    prompts = [p + PREFILL for p in rows["prompt"]]
    torch.manual_seed(cfg.seed)
    sampled = generate(model, tokenizer, prompts, True, cfg)
    greedy = generate(model, tokenizer, prompts, False, cfg)
    return {
        "sampled_t1": score(sampled, rows["answer"]),
        "greedy": score(greedy, rows["answer"]),
        "examples": [{"prompt": p, "sampled": s, "greedy": g} for p, s, g in list(zip(prompts, sampled, greedy))[:4]],
    }


def provenance(
    cfg: BuildConfig, metrics: dict, losses: list[float], n_params: int, seconds: float, argv: list[str]
) -> str:
    """PROVENANCE.md: how this checkpoint was made and how well it does, from this run's own numbers."""
    s, g = metrics["sampled_t1"], metrics["greedy"]
    settings = "\n".join(f"| `{k}` | {v} |" for k, v in dataclasses.asdict(cfg).items())
    examples = "\n\n".join(
        f"```\n{e['prompt']}\n--- sampled (T=1.0):\n{e['sampled']}\n--- greedy:\n{e['greedy']}\n```"
        for e in metrics["examples"]
    )
    return f"""# tiny-arith: provenance

Built by `python scripts/build_tiny_model.py {' '.join(argv)}` (see that script's docstring for the method).
Nothing was downloaded: the data are generated by `grpo.tasks` and the weights are trained from a random
initialisation, on CPU, with fixed seeds and `torch.use_deterministic_algorithms(True)`.

- Architecture: `Qwen2ForCausalLM`, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, MLP {cfg.intermediate},
  tied embeddings, float32; {n_params:,} parameters.
- Tokenizer: byte-level (one token per byte, no merges) plus `<think>`, `</think>`, `<answer>`, `</answer>` as single
  tokens; EOS `{EOS}`, PAD `{PAD}`, BOS `{BOS}` (never added automatically); no chat template.
- Data: the `arithmetic` task, difficulty {cfg.difficulty}, {cfg.train_problems:,} rows of the **train** split (seed
  {cfg.seed}); each batch row gets a fresh noisy-teacher solution (step error rate {cfg.p_step_error}, format error
  rate {cfg.p_format_error}).
- Training: {cfg.steps} steps of batch {cfg.batch_size} (AdamW, peak lr {cfg.lr}, warm-up {cfg.warmup}, cosine to lr/10);
  loss on the completion and EOS only; final loss {losses[-1]:.4f} (mean of the last 100 steps
  {sum(losses[-100:]) / len(losses[-100:]):.4f}).
- Build time: {seconds / 60:.1f} min on {platform.processor() or platform.machine()} with {cfg.threads} thread(s);
  torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}.

## Held-out accuracy

{cfg.eval_n} problems of the **test** split (seed {cfg.seed}, difficulty {cfg.difficulty}), at most {cfg.max_new_tokens} new
tokens. Correct: the last `<answer>` holds the integer answer. Format: `"<think>" + completion` matches the tutorial
seed's format regex.

| decoding | accuracy | format rate |
|---|---|---|
| sampled, temperature 1.0, no top-k/top-p | {s['accuracy']:.3f} | {s['format_rate']:.3f} |
| greedy | {g['accuracy']:.3f} | {g['format_rate']:.3f} |

## Settings

| setting | value |
|---|---|
{settings}

## Examples

{examples}
"""


def _train_and_evaluate(cfg: BuildConfig, log) -> tuple:
    tokenizer = build_tokenizer()
    rows = get_task("arithmetic").dataset("train", n=cfg.train_problems, seed=cfg.seed, difficulty=cfg.difficulty)
    model = make_model(tokenizer, cfg)
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {len(rows):,} train problems")
    losses = train(model, tokenizer, rows.to_list(), cfg, log)
    metrics = evaluate(model, tokenizer, cfg)
    log(f"held-out: sampled T=1.0 {metrics['sampled_t1']}  greedy {metrics['greedy']}")
    return tokenizer, model, metrics, losses


@contextlib.contextmanager
def deterministic(cfg):
    """Seeded, deterministic algorithms, cfg.threads threads; the process-wide switches given back after (tests
    call build in-process)."""
    torch.manual_seed(cfg.seed)
    was_deterministic, was_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(cfg.threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(was_threads)


def write_checkpoint(out: Path, model, tokenizer, provenance_text: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    (out / "PROVENANCE.md").write_text(provenance_text)


def build(out: Path, cfg: BuildConfig, argv: list[str], log=print, train_and_evaluate=None, describe=None) -> dict:
    """Tokenizer, data, training, evaluation, and the checkpoint with its PROVENANCE.md in `out`; returns metrics.
    `train_and_evaluate(cfg, log)` and `describe` (provenance's signature) replace this script's, for another model
    (build_tiny_moe_model.py)."""
    start = time.time()
    with deterministic(cfg):
        tokenizer, model, metrics, losses = (train_and_evaluate or _train_and_evaluate)(cfg, log)
    seconds = time.time() - start
    n_params = sum(p.numel() for p in model.parameters())
    text = (describe or provenance)(cfg, metrics, losses, n_params, seconds, argv)
    write_checkpoint(out, model, tokenizer, text)
    log(f"wrote {out} in {seconds / 60:.1f} min")
    return metrics


def parse_args(argv: list[str], config=BuildConfig, tiny: dict = TINY, doc: str = __doc__) -> tuple[Path, BuildConfig]:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--tiny", action="store_true", help="miniature sizes for a seconds-long end-to-end test")
    for field in dataclasses.fields(config):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=None)
    args = parser.parse_args(argv)
    values = dict(tiny) if args.tiny else {}
    values.update({f.name: getattr(args, f.name) for f in dataclasses.fields(config)
                   if getattr(args, f.name) is not None})
    return args.out, config(**values)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    out, cfg = parse_args(argv)
    return build(out, cfg, argv)


if __name__ == "__main__":
    main()
