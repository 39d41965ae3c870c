"""The analytic FLOP count of one GRPO step: the least matrix-multiply work the step needs, whoever runs it.

Counting rules (a multiply-add is 2 FLOPs; elementwise work such as softmax, sampling and the optimizer is not
counted, so the floor is a lower bound):

* A forward pass over one position costs 2 x (its linear-layer weights) plus attention, 4 x d_q per context
  position per layer (QK^T and AV; d_q = heads x head_dim = H for Qwen2). The output layer costs 2 x H x V per
  position, and only positions whose next token is scored need it.
* One sequence of P prompt and T completion tokens needs its body at P + T - 1 positions (the last token predicts
  nothing) with causal contexts 1 .. P+T-1, and its output layer at the T positions that predict completion tokens.
* Generation with a KV cache does exactly that too: the prompt once, then T - 1 single-token steps, each reading the
  cache; the last token is sampled from the logits of step T - 1.
* Scoring the reference log-probs (beta > 0) is one such forward.
* The old-policy log-probs (num_iterations > 1) are not counted: the first update's forward, before any weight
  changes, already gives them (both trainers measured here do run a separate pass for them).
* Each update is a forward and a backward. Backward costs 2 x forward for trained weights (gradients of the
  activations and of the weights) and 1 x forward for frozen ones (activations only: LoRA's base weights and the
  output layer under LoRA); attention's backward is 2 x its forward. LoRA adds r x (in + out) weights per adapted
  linear layer, trained.
* Activation recomputation (gradient checkpointing) is not counted: it is a memory trade, not work the step needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.workloads import Workload


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step, all B x G sequences together."""

    generation: float
    reference: float
    update: float  # all num_iterations forward+backward passes

    @property
    def total(self) -> float:
        return self.generation + self.reference + self.update


def linear_shapes(w: Workload) -> list[tuple[int, int]]:
    """(in, out) of every linear layer in one decoder layer: q, k, v, o projections and the gated MLP."""
    head_dim = w.hidden // w.heads
    q, kv = w.heads * head_dim, w.kv_heads * head_dim
    return [(w.hidden, q), (w.hidden, kv), (w.hidden, kv), (q, w.hidden),
            (w.hidden, w.intermediate), (w.hidden, w.intermediate), (w.intermediate, w.hidden)]


def layer_weights(w: Workload) -> int:
    """Linear weights of one decoder layer (biases and norms are elementwise, not counted)."""
    return sum(i * o for i, o in linear_shapes(w))


def lora_weights(w: Workload) -> int:
    """LoRA weights of one decoder layer: r x (in + out) per adapted linear layer (all but the output layer)."""
    return sum(w.lora_r * (i + o) for i, o in linear_shapes(w)) if w.lora_r else 0


def sequence_forward(w: Workload) -> tuple[float, float, float]:
    """(body linear, attention, output layer) FLOPs of one forward over one prompt + completion."""
    positions = w.prompt_length + w.completion_length - 1
    contexts = positions * (positions + 1) // 2  # sum of causal context lengths 1 .. positions
    body = 2.0 * positions * w.layers * layer_weights(w)
    attention = 4.0 * w.layers * (w.heads * (w.hidden // w.heads)) * contexts
    head = 2.0 * w.completion_length * w.hidden * w.vocab
    return body, attention, head


def step_flops(w: Workload) -> StepFlops:
    """The floor's FLOPs for one step of workload w (module docstring: the rules)."""
    n = w.completions_per_step
    body, attention, head = sequence_forward(w)
    forward = body + attention + head
    positions = w.prompt_length + w.completion_length - 1
    lora = 2.0 * positions * w.layers * lora_weights(w)  # the adapters' forward (0 without LoRA)
    if w.lora_r:
        one_update = 2 * forward + 3 * lora  # frozen base: forward + activation gradients; adapters: x3
    else:
        one_update = 3 * forward
    # The policy samples with its adapters; the reference is the base network (adapters off).
    return StepFlops(generation=n * (forward + lora), reference=n * forward if w.beta > 0 else 0.0,
                     update=n * w.num_iterations * one_update)
