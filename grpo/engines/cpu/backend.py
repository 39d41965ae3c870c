"""The CPU engine's update side: the loss's gradient formed in the log-prob pass, and the float32-CPU paths around it.

`CPUBackend` is `TransformersBackend` plus, for one unwrapped process on the CPU:
* the one-pass loss gradient (`completion_loss`, `grpo.engines.head.hidden_loss`): the LM head applied three times instead
  of four, through a buffer of whole rows' logits when a micro-batch's fit in 32 MiB (128 MiB for a frozen head),
  otherwise seeded by the sampler's own log-probs (no buffer) where those are the update's up to rounding, otherwise
  a few rows at a time, and where one row does not fit either, two passes;
* the compiled tile kernels for the head's softmax passes;
* the head's gradient memory lent to the next rollout, which packs the head into it (`CPUSampler.head_space`);
* the tied embedding's gradient made sparse, and the MLPs and RMSNorms switched to fused C passes (`fused.py`),
  both undone by `release()`.
Every path computes the plain backend's numbers up to float32 rounding (tests/test_trainer.py).
"""

from __future__ import annotations

import torch

from grpo.core import LossOutput
from grpo.engines.head import hidden_loss
from grpo.engines import policy
from grpo.engines.base import SamplingParams
from grpo.engines.cpu import attention, decoding, native
from grpo.engines.cpu.fused import fuse_decoder_ops, unfuse_decoder_ops
from grpo.engines.cpu.sampler import CPUSampler
from grpo.engines.packing import PackedRows, Packing
from grpo.engines.policy import LossFn, MicroBatch, TransformersBackend, dropout_active, plain_head


class CPUBackend(TransformersBackend):
    """The update of an unwrapped float32 model in one process on the CPU (see the module docstring).

    `sampler`: the run's rollout engine; its log-probs seed the one-pass loss only when it is this engine's own
    `CPUSampler` of this model, sampling without filters (`params`). `reference`: the frozen reference copy, if any,
    whose MLPs and norms are fused too."""

    name = "cpu"
    tile_kernels = staticmethod(native.tile_kernels)

    def __init__(self, model, accelerator, sampler, params: SamplingParams, reference=None):
        super().__init__(model, accelerator)
        self.sampler, self.reference = sampler, reference
        head = plain_head(model)
        # hidden_loss adds the head's weight gradient during forward, so backward must not rescale the loss.
        self.fused_loss = accelerator.scaler is None and accelerator.gradient_accumulation_steps == 1
        self.frozen_head = head is not None and not head.weight.requires_grad
        # The sampler's own log-probs are the first update pass's up to float32 rounding when it sampled from the
        # same weights without filters; the one-pass loss then applies the LM head 3 times instead of 4 (a frozen
        # head, which needs them only roughly, 2 instead of 3 and no buffer): hidden_loss's logp_estimate. Not
        # where training-mode dropout makes the update's forward differ from sampling's. (A bfloat16 or float16
        # trained head rounds its logits too coarsely for the estimates to count as exact.)
        own_sampler = isinstance(sampler, CPUSampler) and sampler.model is model
        self.sampling_estimates = (self.fused_loss and params.unfiltered and own_sampler and head is not None
                                   and (self.frozen_head or (not dropout_active(model)
                                                             and head.weight.dtype in (torch.float32, torch.float64))))
        # Sampling's packed copy of a trained head is the size of the head's gradient, and the next rollout starts
        # right after the optimizer step drops that gradient: its memory is handed over (`_head_grad_storage`,
        # `after_optimizer_step`), sparing the pack a fresh allocation whose first touch page-faults every 4 KiB
        # (~40-60 ms per rollout for a 151k vocabulary's 155 MB head). It is not kept past the rollout, so the
        # reference pass and the update hold no more memory than without it.
        self.lend_head_grad = (self.sampling_estimates and not self.frozen_head and head.weight.device.type == "cpu"
                               and head.weight.dtype == torch.float32 and torch.get_num_threads() == 1
                               and native.library() is not None  # (the packed copy is the compiled head's,
                               and native.library().lean_wide_vectors()  # which sampling takes with AVX-512
                               and head.weight.numel() > decoding._SMALL_HEAD)  # for a head not kept as it is)
        self._head_grad_space: torch.Tensor | None = None  # the flat memory under the head's gradient, when lent
        self.sparse_embedding = False
        self.prepare()

    def _modules(self) -> list:
        return [self.model] + ([getattr(self.reference, "module", self.reference)] if self.reference is not None
                               else [])

    def packing(self, model, enabled: bool) -> tuple[Packing | None, str]:
        """Shared prompts in one row with the grouped attention (`attention.py`) where `prepare` switched the
        model's attention to it; otherwise transformers' packing."""
        if enabled and attention.switched(model):
            return Packing(True, "prefix", None, "grouped sdpa"), ""
        return super().packing(model, enabled)

    def prepare(self) -> None:
        self.sparse_embedding = sparse_tied_embedding_grad(self.model)
        for module in self._modules():  # the MLP activations and RMSNorms as compiled passes; grouped attention
            fuse_decoder_ops(module)
            attention.use_prefix_attention(module)

    def release(self) -> None:
        if self.sparse_embedding:
            sparse_tied_embedding_grad(self.model, sparse=False)
        for module in self._modules():
            unfuse_decoder_ops(module)
            attention.restore_attention(module)
        self._head_grad_space = None
        if isinstance(self.sampler, CPUSampler):
            self.sampler.head_space = None

    def loss_and_backward(self, micro: MicroBatch, temperature: float, loss_fn: LossFn,
                          with_entropy: bool, entropy_in_loss: bool = False) -> tuple[torch.Tensor, LossOutput]:
        if not self.fused_loss or entropy_in_loss:  # (the one-pass loss takes no entropy term)
            return super().loss_and_backward(micro, temperature, loss_fn, with_entropy, entropy_in_loss)
        # An estimate of the log-probs: the sampler's in the first pass; for a frozen head, the last pass's.
        sampled = micro.sampling_logp if self.sampling_estimates else None
        estimate = None
        if micro.old_logp is None and sampled is not None:
            estimate = sampled
        elif self.frozen_head and micro.old_logp is not None and sampled is not None:
            estimate = micro.old_logp
        storage = self._head_grad_storage()
        fused = completion_loss(self.model, micro.input_ids, micro.attention_mask, micro.width, temperature,
                                lambda lp, rows: loss_fn(lp, rows, None).loss, with_entropy=with_entropy,
                                logp_estimate=estimate, weight_grad_storage=storage, packed=micro.packed)
        if storage is not None:
            grad = plain_head(self.model).weight.grad
            if grad is None or grad.data_ptr() != storage.data_ptr():
                self._head_grad_space = None  # not taken (the two-pass path makes its own): not held either
        if fused is None:
            return super().loss_and_backward(micro, temperature, loss_fn, with_entropy)
        loss, logp, entropy = fused
        result = loss_fn(logp, slice(None), entropy)  # the whole micro-batch's metrics
        self.backward(loss)
        return logp, result

    def after_optimizer_step(self, stepped: bool) -> None:
        # no gradient buffers are held through the next rollout but the head's, whose memory it packs the head into
        if stepped and self._head_grad_space is not None:
            self.sampler.head_space = self._head_grad_space
        self._head_grad_space = None

    def _head_grad_storage(self) -> torch.Tensor | None:
        """Memory for the head's gradient when it is about to be made (`lend_head_grad` and no .grad yet): the
        head's shape, at the start of a flat buffer large enough for the packed copy it is lent to next."""
        if not self.lend_head_grad:  # (which implies a plain linear head)
            return None
        weight = plain_head(self.model).weight
        if weight.grad is not None:
            return None
        # A later iteration over the same rollout takes back what the last optimizer step lent (not yet packed into).
        space, self.sampler.head_space = self.sampler.head_space, None
        if space is None:
            space = torch.empty(max(weight.numel(), native.packed_floats(native.library(), weight)))
        self._head_grad_space = space
        return space[:weight.numel()].view_as(weight)


_FUSED_ELEMENTS = 2**23
"""Largest (rows x T, V) float32 logit buffer `completion_loss` holds when the head is trained (32 MiB); longer
rows take two passes. Measured on the benchmark's W2 (one 64-token row of a 151k vocabulary is 37 MiB): a 111 MiB
buffer saves ~0.3 s of a 7 s step over two passes (4 head products against 3) and costs 111 MiB of peak memory,
and a one-row buffer is no faster than two passes."""

_FUSED_ELEMENTS_FROZEN_HEAD = 2**25
"""The same for a frozen head (LoRA): 128 MiB. There the buffer saves a third of the head's work (2 products
against 3; no weight gradient), 0.67 s of W3's 2-iteration update, and no (V, H) gradient shares the memory."""


def completion_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                    temperature: float, row_loss, with_entropy: bool = False,
                    logp_estimate: torch.Tensor | None = None, weight_grad_storage: torch.Tensor | None = None,
                    packed: PackedRows | None = None):
    """The loss `row_loss(logp rows, rows)` summed over the rows of this micro-batch, with its gradient formed in the
    same pass as the log-probs (`grpo.engines.head.hidden_loss`: the LM head applied three times instead of four).

    Rows are scored a few at a time into a buffer of their full logits, capped at _FUSED_ELEMENTS
    (_FUSED_ELEMENTS_FROZEN_HEAD for a frozen head). When the buffer cannot hold every row at once and
    `logp_estimate` (N, T) is given (the sampler's log-probs of these tokens, or for a frozen head any close
    estimate), every row goes through one pass over the vocabulary with no buffer instead (hidden_loss's
    logp_estimate).

    `weight_grad_storage`: memory of the head weight's shape for its gradient when `.grad` is None (hidden_loss's
    weight_grad_storage), or None.

    `packed`: the padding-free layout of these rows (grpo.engines.packing): the decoder runs on it and the head on
    the real tokens only (`hidden_loss`'s layout); the rows, log-probs and estimates stay (N, T).

    Returns (loss, logp (N, T) detached, entropy (N, T) detached or None), or None when this path does not apply:
    a head that is not a plain linear layer, or, without an estimate, one row's (T, V) logits larger than the cap.
    Only for an unwrapped model in one process trained with `loss.backward()` (the head's weight gradient is added
    to its .grad during forward).
    """
    head = plain_head(model)
    per_row = completion_len * (head.weight.shape[0] if head is not None else 0)
    cap = _FUSED_ELEMENTS if head is None or head.weight.requires_grad else _FUSED_ELEMENTS_FROZEN_HEAD
    if input_ids.shape[0] * per_row <= cap:  # the buffer holds every row: one pass with no estimate (measured
        logp_estimate = None  # faster on the benchmark's W1, whose 100-token head is cheap next to the loss)
    if head is None or per_row == 0 or (logp_estimate is None and per_row > cap):
        return None
    if packed is not None:
        hidden, tokens = policy.packed_hidden(model, packed), packed.targets  # (n_tok, H), (n_tok,)
    else:
        hidden = policy._completion_hidden(model, input_ids, attention_mask, completion_len)
        tokens = input_ids[:, -completion_len:]
    return hidden_loss(hidden, head.weight, tokens, row_loss, temperature, bias=head.bias,
                       with_entropy=with_entropy, rows_per_chunk=max(1, cap // per_row),
                       weight_grad_in_place=head.weight.is_leaf,
                       kernels=native.tile_kernels(hidden.dtype, hidden.device), logp_estimate=logp_estimate,
                       weight_grad_storage=weight_grad_storage if head.weight.is_leaf else None,
                       layout=None if packed is None else packed.layout)


def sparse_tied_embedding_grad(model, sparse: bool = True) -> bool:
    """When the input embedding and the LM head share one trainable weight (tied embeddings), make the embedding's
    own gradient sparse: the rows of the tokens in the batch instead of a dense (V, H) buffer. The LM head's dense
    gradient reaches the shared weight first in backward and the sparse rows are added into it in place, so the
    weight's `.grad` stays dense (as AdamW needs) and no second (V, H) tensor is made per micro-batch (155 MB for
    a 151k x 256 vocabulary). Only for an unwrapped model in one process: DDP treats sparse embeddings specially.
    `sparse=False` undoes it; the trainer does when training ends, so the model goes back as it was loaded (a loss
    of the user's that does not pass through the head, on hidden states say, would otherwise leave a sparse
    gradient, which AdamW refuses). Returns whether it applied."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (type(emb) is torch.nn.Embedding and head is not None and getattr(head, "weight", None) is emb.weight
            and emb.weight.requires_grad):
        emb.sparse = sparse
        return True
    return False
