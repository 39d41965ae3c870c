"""One process of a sequence-parallel check (test_sequence_parallel.py), launched by torch.distributed.run with gloo:

    python -m torch.distributed.run --nproc_per_node SP ulysses_driver.py OUT_DIR KV_HEADS TOKENS [MODE ...]

For each MODE (default: plain) every process builds the same tiny Qwen2 model (4 attention heads, KV_HEADS
key/value heads) and the same packed micro-batch of about TOKENS tokens, computes the one-process packed pass
(transformers' sdpa on the packed sequences, masked from the position ids) and the Ulysses pass over all processes,
sums the Ulysses gradients over the group, and writes OUT_DIR/MODE/rank<R>.json: the largest relative difference
of the log-probs, the entropies, the loss and each trained parameter's gradient. Modes (`MODES`):
    plain          the model as built (the tiled LM head)
    checkpointing  gradient checkpointing on (non-reentrant, as the trainer sets it): backward recomputes each
                   layer's forward, its all_to_alls included
    lora           LoRA on every linear layer but the head (the tiled head on the LoRA model's decoder)
    lora-head      LoRA on the attention's projections and the LM head: the head is no plain linear, so both
                   passes take the model's own forward and logits (the path FSDP2 and ZeRO-3 take)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.engines.packing import Packing, pack
from grpo.engines.policy import completion_logprobs
from grpo.engines.ulysses import SequenceGroup, installed, sequence_parallel_logprobs

ONE_ROW = Packing(False, None, None, "sequence parallel: whole sequences in one row")


def tiny_model(kv_heads: int, layers: int = 2, hidden: int = 64, vocab: int = 300, context: int = 16384):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=context,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def micro_batch(tokens: int, rows: int = 4, prompt: int = 48, vocab: int = 300, seed: int = 1):
    """(input_ids, attention_mask (rows, prompt + width), width): prompts left-padded, completions right-padded, of
    unequal lengths adding up to about `tokens`."""
    g = torch.Generator().manual_seed(seed)
    width = (tokens - rows * prompt) // rows + 40
    plen = [prompt - 7 * r for r in range(rows)]
    clen = [width - 37 * r for r in range(rows)]
    ids = torch.randint(1, vocab, (rows, prompt + width), generator=g)
    mask = torch.zeros_like(ids)
    for r in range(rows):
        mask[r, prompt - plen[r]:prompt + clen[r]] = 1
    return ids * mask, mask, width


def with_mode(model, mode: str):
    """`model` as MODE wants it (see the module docstring)."""
    if mode == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert model.training  # (checkpointing applies in training mode only)
    elif mode in ("lora", "lora-head"):
        from peft import LoraConfig, get_peft_model

        targets = "all-linear" if mode == "lora" else ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
        torch.manual_seed(2)
        for name, p in model.named_parameters():  # (lora_B starts at 0: give the adapters a delta, A a gradient)
            if "lora_B" in name:
                p.data.normal_(0, 0.1)
    elif mode != "plain":
        raise ValueError(f"ulysses_driver: unknown mode {mode!r}; one of {MODES}")
    return model


MODES = ("plain", "checkpointing", "lora", "lora-head")


def loss_of(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A loss that is not a plain token sum: each row's mean weighted by an advantage, and an entropy bonus."""
    adv = torch.linspace(-1.0, 1.0, logp.shape[0])
    rows = (logp * mask).sum(1) / mask.sum(1)
    return -(adv * rows).mean() - 0.01 * (entropy * mask).sum() / mask.sum()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def compare(out: Path, sp: SequenceGroup, kv_heads: int, tokens: int, mode: str) -> None:
    model = with_mode(tiny_model(kv_heads), mode)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ids, mask, width = micro_batch(tokens)
    packed = pack(ids, mask, width, ONE_ROW)
    real = mask[:, -width:].float()

    logp, entropy = completion_logprobs(model, ids, mask, width, 0.9, with_entropy=True, entropy_grad=True,
                                        packed=packed)
    loss = loss_of(logp, entropy, real)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trained}
    model.zero_grad(set_to_none=True)

    with installed(model):
        sp_logp, sp_entropy = sequence_parallel_logprobs(model, packed, sp, 0.9, with_entropy=True,
                                                         entropy_grad=True)
        sp_loss = loss_of(sp_logp, sp_entropy, real)
        sp_loss.backward()
    result = {"logp": rel(sp_logp, logp), "entropy": rel(sp_entropy, entropy), "loss": rel(sp_loss, loss),
              "tokens": packed.tokens, "scored": int(real.sum()), "grads": {}}
    for name, p in trained:
        dist.all_reduce(p.grad, group=sp.group)  # each rank holds its slice's part of the gradient
        result["grads"][name] = rel(p.grad, grads[name])
    (out / mode).mkdir(parents=True, exist_ok=True)
    (out / mode / f"rank{sp.rank}.json").write_text(json.dumps(result))


def main(out: Path, kv_heads: int, tokens: int, modes: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in modes:
        compare(out, SequenceGroup(dist.group.WORLD, rank, dist.get_world_size()), kv_heads, tokens, mode)
    dist.barrier()
    dist.destroy_process_group()
    # The results are written; the process leaves without finalizing the interpreter. Finalizing aborted about 1 run
    # in 10 (SIGABRT, "terminate called without an active exception"; a core dump's backtrace): a gloo worker thread
    # destroyed the barrier's work after the main thread had begun Py_FinalizeEx. That work holds the collectives
    # queued before it, whose tensors (the gradients all-reduced above) are Python's, so freeing them takes the GIL,
    # and Python ends a thread that asks for it while finalizing with pthread_exit, whose unwinding through the C++
    # destructor calls std::terminate. destroy_process_group does not join gloo's workers while any Python object
    # still holds the group (torch 2.13), and after the SP forward something the garbage collector cannot see holds
    # this one (2 references more than before it; not found), so its workers outlive main().
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] or ["plain"])
