"""Build `grpo/assets/tiny-moe`: tiny-arith's task and method on a Qwen3-MoE-shaped model.

    python scripts/build_tiny_moe_model.py --out grpo/assets/tiny-moe        # the shipped checkpoint
    python scripts/build_tiny_moe_model.py --out /tmp/x --tiny                 # a miniature end-to-end run, seconds

The method is `build_tiny_model.py`'s, unchanged (its docstring): the byte-level tokenizer, the noisy teacher's
arithmetic solutions, the AdamW loop, fixed seeds, `torch.use_deterministic_algorithms(True)`, CPU, float32, one
thread, the held-out evaluation and PROVENANCE.md. Only the model differs: a `Qwen3MoeForCausalLM` whose every
decoder layer's MLP is a sparse block of `experts` experts (SwiGLU, `expert_intermediate` wide) of which a router
picks `top_k` per token (softmax over all experts, then the top-k, renormalised: `norm_topk_prob`), tied
embeddings, and the load-balancing loss of the model's own (`router_aux_loss_coef`) added during pre-training so
that no expert goes unused.

The shipped checkpoint: `--steps 1500 --batch-size 32 --warmup 100` (tiny-arith's 1,500 steps at half its batch),
1,085,696 parameters (4.3 MB), 24.3 min on a 2-core CPU shared with other jobs. Measured at build time on 500
held-out problems (PROVENANCE.md): sampled at temperature 1.0, accuracy 0.202 and format rate 0.908; greedy, 0.542
and 1.0. It writes the task's format; its arithmetic is what GRPO has to improve. (The first build, 600 steps with
warm-up 50: 0.108 sampled, 0.092 greedy; GRPO's recipe took it only from 0.080 to 0.118 held out.)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
import build_tiny_model  # noqa: E402
from build_tiny_model import BuildConfig, parse_args  # noqa: E402


@dataclasses.dataclass
class MoeBuildConfig(BuildConfig):
    """tiny-arith's settings plus the experts'; `intermediate` is unused (every layer is sparse)."""

    experts: int = 4
    top_k: int = 2
    expert_intermediate: int = 128
    router_aux_loss_coef: float = 0.01


TINY = dict(build_tiny_model.TINY, experts=4, top_k=2, expert_intermediate=16)


def make_moe_model(tokenizer, cfg: MoeBuildConfig) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, head_dim=cfg.hidden // cfg.heads,
        intermediate_size=cfg.intermediate, moe_intermediate_size=cfg.expert_intermediate,
        num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3MoeForCausalLM(config)


def _train_and_evaluate(cfg: MoeBuildConfig, log) -> tuple:
    tokenizer = build_tiny_model.build_tokenizer()
    rows = build_tiny_model.get_task("arithmetic").dataset(
        "train", n=cfg.train_problems, seed=cfg.seed, difficulty=cfg.difficulty)
    model = make_moe_model(tokenizer, cfg)
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {len(rows):,} train problems")
    data = rows.to_list()

    def step_loss(rng):
        # The model adds router_aux_loss_coef * its load-balancing loss to `loss` when asked for router logits.
        return model(**build_tiny_model.training_batch(tokenizer, data, rng, cfg), output_router_logits=True).loss

    losses = build_tiny_model.train(model, tokenizer, data, cfg, log, step_loss=step_loss, stream="build_tiny_model")
    metrics = build_tiny_model.evaluate(model, tokenizer, cfg)
    log(f"held-out: sampled T=1.0 {metrics['sampled_t1']}  greedy {metrics['greedy']}")
    return tokenizer, model, metrics, losses


def provenance(cfg: MoeBuildConfig, metrics, losses, n_params, seconds, argv) -> str:
    text = build_tiny_model.provenance(cfg, metrics, losses, n_params, seconds, argv)
    text = text.replace("# tiny-arith: provenance", "# tiny-moe: provenance")
    text = text.replace("scripts/build_tiny_model.py", "scripts/build_tiny_moe_model.py")
    return text.replace(
        f"- Architecture: `Qwen2ForCausalLM`, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
        f"MLP {cfg.intermediate},",
        f"- Architecture: `Qwen3MoeForCausalLM`, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads; every "
        f"layer's MLP {cfg.experts} experts of width {cfg.expert_intermediate}, top-{cfg.top_k} routing "
        f"(renormalised), load-balancing loss weight {cfg.router_aux_loss_coef} in pre-training;",
    )


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    out, cfg = parse_args(argv, MoeBuildConfig, TINY, __doc__)
    return build_tiny_model.build(out, cfg, argv, train_and_evaluate=_train_and_evaluate, describe=provenance)


if __name__ == "__main__":
    main()
