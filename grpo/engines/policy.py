"""The update side of an engine: the policy's log-probs and the loss's backward, through `transformers`' forward.

`TransformersBackend` is the plain backend any model and device can take: the decoder's hidden states at the
completion positions go through the LM head in cache-sized tiles (`grpo.engines.head.hidden_logprobs`), so the (N, T, V)
logits never exist, and the loss is backpropagated through them. The CPU engine's `CPUBackend` extends it with the
one-pass loss gradient and other float32-CPU paths; the trainer calls the same four methods of either.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from grpo.core import LossOutput
from grpo.engines.head import hidden_logprobs, token_entropy, token_logprobs
from grpo.engines.images import is_vision_config, own_positions, vision_zero
from grpo.engines.kv_cache import cache_args, distinct_rows, expand_cache, positions as position_ids, preallocated_cache
from grpo.engines.offload import ActivationOffload, OffloadStats
from grpo.engines.packing import PackedRows, Packing, choose_packing
from grpo.engines.sharding import is_peft, sharding


@dataclass
class MicroBatch:
    """One micro-batch of the update, on the model's device. Rows are prompts left-padded and completions
    right-padded; the last `width` columns of `input_ids` (n, P+width) are the completion tokens. With `packed`,
    the passes run on its padding-free layout of the same rows instead (grpo.engines.packing); every per-token
    tensor stays (n, width)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    width: int
    old_logp: torch.Tensor | None = None  # (n, width): the sampling policy's log-probs, once known
    sampling_logp: torch.Tensor | None = None  # (n, width): the rollout engine's own log-probs, where it gave them
    packed: PackedRows | None = None
    images: list | None = None  # (n,) each row's image features (grpo.engines.images.RowImages), on the CPU
    routes: torch.Tensor | None = None  # (R*L, layers, k): an MoE rollout's experts per packed position (engines.moe)


LossFn = Callable[[torch.Tensor, slice, "torch.Tensor | None"], LossOutput]
"""loss_fn(logp (rows, width), rows, entropy or None) -> LossOutput: the step's loss over those rows of the
micro-batch (the trainer's `grpo.core.policy_loss` with the run's settings)."""


class UpdateBackend(Protocol):
    """The update half of an engine: every call the trainer makes of it (grpo.training.update.mechanics, the trainer).
    `TransformersBackend` runs any model on any device; the CPU engine's `CPUBackend` extends it."""

    name: str

    def packing(self, model, enabled: bool) -> tuple[Packing | None, str]: ...

    def prepare(self) -> None: ...

    def release(self) -> None: ...

    def logprobs(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int,
                 temperature: float, packed: PackedRows | None = None,
                 images: list | None = None) -> torch.Tensor: ...

    def loss_and_backward(self, micro: MicroBatch, temperature: float, loss_fn: LossFn, with_entropy: bool,
                          entropy_in_loss: bool = False) -> tuple[torch.Tensor, LossOutput]: ...

    def after_optimizer_step(self, stepped: bool) -> None: ...


class TransformersBackend:
    """Log-probs and the loss's backward for `model` (as accelerate prepared it: DDP, FSDP, DeepSpeed or plain)."""

    name = "transformers"
    tile_kernels = None  # (dtype, device) -> compiled kernels for the head's tiles, or None: the CPU engine's
    extra_loss = None  # () -> a term added to the loss before backward, or None (grpo.engines.moe: the aux loss)

    def __init__(self, model, accelerator, sp=None, offload: bool = False):
        self.model, self.accel = model, accelerator
        self.sp = sp  # this process's sequence-parallel group (grpo.engines.ulysses), or None
        self.offload = offload  # the update's saved activations in host memory (grpo.engines.offload)
        self.offloaded: OffloadStats | None = None  # what the last update pass's offload saw, when on

    def packing(self, model, enabled: bool) -> tuple[Packing | None, str]:
        """How this backend's passes pack micro-batches for `model` (None: padded, and why). Sequence-parallel:
        whole sequences in one row, which the group's processes split (grpo.engines.ulysses)."""
        if enabled and is_vision_config(getattr(model, "config", None)):
            packing, why = None, "a vision-language model: packed passes do not carry image features yet"
        else:
            packing, why = choose_packing(model, enabled)
        if self.sp is None:
            return packing, why
        if packing is None:
            raise ValueError(f"sequence_parallel_size={self.sp.size} splits packed micro-batches, but this model's "
                             f"passes cannot be packed ({why}); use sequence_parallel_size: 1.")
        self.sp.check_heads(model.config)
        return Packing(False, None, None, f"Ulysses over {self.sp.size} processes"), ""

    def prepare(self) -> None:
        """Ready the model for training (the plain backend changes nothing)."""

    def release(self) -> None:
        """Undo what `prepare` changed, so the model and the process are as they were."""

    def logprobs(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int,
                 temperature: float, packed: PackedRows | None = None, images: list | None = None) -> torch.Tensor:
        """(n, width) log-probs of the completion tokens under `model` (the policy or the reference), through the
        packed layout `packed` of these rows when given (0 past each row's end), with the rows' `images`."""
        with self._sequence_parallel(model):
            return self._passes(model, input_ids, attention_mask, width, temperature, packed, images)

    def loss_and_backward(self, micro: MicroBatch, temperature: float, loss_fn: LossFn,
                          with_entropy: bool, entropy_in_loss: bool = False) -> tuple[torch.Tensor, LossOutput]:
        """Backpropagate the micro-batch's loss; returns (its log-probs (n, width) detached, its LossOutput).
        `entropy_in_loss`: the loss uses the entropies (an entropy bonus or mask), so they keep their gradient.
        The forward and the loss run under the run's autocast (mixed precision), the backward outside it, as torch
        advises (autograd replays the forward's casts)."""
        with self._sequence_parallel(self.model):  # (the backward too: checkpointing recomputes the forward in it)
            with self.accel.autocast(), self._offload():
                out = self._passes(self.model, micro.input_ids, micro.attention_mask, micro.width, temperature,
                                   micro.packed, micro.images, with_entropy or entropy_in_loss, entropy_in_loss)
                logp, entropy = out if with_entropy or entropy_in_loss else (out, None)
                result = loss_fn(logp, slice(None), entropy)
            # (a micro-batch that cannot be packed runs whole on every process of its group: its share, once)
            self.backward(result.loss / self.sp.size if self.sp is not None and micro.packed is None else result.loss)
        return logp.detach(), result

    def _offload(self):
        """Saved-tensor hooks moving the update forward's activations to host memory (`activation_offloading`);
        backward unpacks them after the block has closed."""
        if not self.offload:
            return contextlib.nullcontext()
        hooks = ActivationOffload(self.model)
        self.offloaded = hooks.stats
        return hooks

    def _sequence_parallel(self, model):
        return self.sp.installed(model) if self.sp is not None else contextlib.nullcontext()

    def _passes(self, model, input_ids, attention_mask, width: int, temperature: float, packed, images,
                with_entropy: bool = False, entropy_grad: bool = False):
        """completion_logprobs, or its sequence-parallel split for a packed micro-batch (inside _sequence_parallel)."""
        if self.sp is not None and packed is not None:
            return self.sp.logprobs(model, packed, temperature, with_entropy, entropy_grad,
                                    tile_kernels=self.tile_kernels)
        return completion_logprobs(model, input_ids, attention_mask, width, temperature, with_entropy=with_entropy,
                                   tile_kernels=self.tile_kernels, entropy_grad=entropy_grad, packed=packed,
                                   images=images)

    def backward(self, loss: torch.Tensor) -> None:
        extra = self.extra_loss() if self.extra_loss is not None else None
        loss = loss if extra is None else loss + extra
        # DDP averages gradients over processes; the loss is already a share of the global sum, so undo the mean.
        self.accel.backward(loss * self.accel.num_processes)

    def after_optimizer_step(self, stepped: bool) -> None:
        """Called after each optimizer step (`stepped` False: skipped for a non-finite gradient)."""


@contextlib.contextmanager
def reference_view(policy, reference):
    """The network that scores the reference log-probs: the frozen copy (the CPU engine's `DiskReference` maps its
    weights in for the block), or the policy with adapters off."""
    if hasattr(reference, "loaded"):
        with reference.loaded() as module:
            yield module
    elif reference is not None:
        yield reference
    elif is_peft(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise RuntimeError("reference_view: beta > 0 needs a reference model or a LoRA policy.")


def _completion_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int):
    """The decoder's final hidden states (N, T, H) at the positions that predict the last T tokens (P-1 .. P+T-2)."""
    if not torch.is_grad_enabled():  # (with gradients, sharing measured no faster on the benchmark's W1)
        shared = _shared_prompt_hidden(model, input_ids, attention_mask, completion_len)
        if shared is not None:
            return shared
    # The last token predicts nothing: it is left out.
    out = model.get_decoder()(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                              position_ids=position_ids(attention_mask)[:, :-1], use_cache=False)
    return out.last_hidden_state[:, -completion_len:, :].contiguous()


def _shared_prompt_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int):
    """`_completion_hidden` without gradients when rows share a prompt (a group's G completions): each distinct
    prompt runs through the decoder once into a cache, the cache is copied to the rows that share it, and the
    completions run on top of it. The same hidden states up to rounding, for 1/G of the prompts' work. None when no
    prompt repeats or the model's cache is not made of plain full-attention layers."""
    prompt_len = input_ids.shape[1] - completion_len
    if prompt_len < 1 or completion_len < 2:  # (one completion token: the prompt's last position predicts it all)
        return None
    first, copies = distinct_rows(torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len]], 1).tolist())
    cache = preallocated_cache(model, input_ids.shape[1] - 1) if len(first) < input_ids.shape[0] else None
    if cache is None:
        return None
    first, copies = (torch.tensor(v, device=input_ids.device) for v in (first, copies))
    positions = position_ids(attention_mask)
    decoder = model.get_decoder()
    head = decoder(input_ids=input_ids[first, :prompt_len], attention_mask=attention_mask[first, :prompt_len],
                   position_ids=positions[first, :prompt_len], use_cache=True, **cache_args(decoder, cache))
    if not all(layer.is_initialized for layer in cache.layers):
        return None  # the model declined the cache (gradient checkpointing in training mode, e.g. a LoRA reference)
    expand_cache(cache, copies)
    tail = decoder(input_ids=input_ids[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
                   position_ids=positions[:, prompt_len:-1], use_cache=True, **cache_args(decoder, cache))
    return torch.cat([head.last_hidden_state[copies, -1:], tail.last_hidden_state], dim=1).contiguous()


def packed_hidden(model, packed: PackedRows, inner=None) -> torch.Tensor:
    """The decoder's final hidden states (n_tok, H) at the positions that predict the scored tokens of a packed
    micro-batch (`PackedRows.score_index`); `inner`: the module a DDP `model` wraps (`tiled_head`)."""
    mask = packed.attention_mask(_dtype(model, packed.input_ids.device))
    inputs = dict(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, use_cache=False,
                  **packed.attention_kwargs())
    hidden = (model.get_decoder()(**inputs).last_hidden_state if inner is None
              else wrapped_hidden(model, inner, inputs))  # (R, L, H)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.score_index)


def wrapped_hidden(model, inner, inputs: dict) -> torch.Tensor:
    """The decoder's final hidden states from a forward through the wrapper `model` (so DDP prepares its gradient
    reduction as usual), caught by a hook on `inner`'s decoder; the model's own head runs on the last position only
    (logits_to_keep=1: (N, 1, V), unused)."""
    caught = []
    handle = inner.get_decoder().register_forward_hook(lambda module, args, out: caught.append(out.last_hidden_state))
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    return caught[-1]


def _in_place(head, inner) -> bool:
    """Whether the head's weight gradient may go straight into .grad: not under DDP, whose gradient hooks fire only
    on gradients that autograd accumulates."""
    return head.weight.is_leaf and inner is None


def _dtype(model, device: torch.device) -> torch.dtype:
    """The dtype attention computes in, for an additive mask that no layer converts (a converted copy is kept for
    backward in every layer): autocast's where it is on for `device`, else the model's activations' (that of its
    input embedding)."""
    from accelerate.utils import extract_model_from_parallel

    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    model = extract_model_from_parallel(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    return weight.dtype if weight is not None and weight.is_floating_point() else torch.float32


def head_logprobs(hidden: torch.Tensor, head, inner, targets: torch.Tensor, temperature: float, with_entropy: bool,
                  tile_kernels):
    """`grpo.engines.head.hidden_logprobs` of hidden (N, T, H) through `tiled_head`'s (head, inner): (logp, entropy or None).
    The head's weight gradient goes straight into .grad (no (V, H) temporary per micro-batch) on an unwrapped model,
    on which the trainer calls .backward()."""
    return hidden_logprobs(hidden, head.weight, targets, temperature=temperature, bias=head.bias,
                           with_entropy=with_entropy, weight_grad_in_place=_in_place(head, inner),
                           kernels=tile_kernels and tile_kernels(hidden.dtype, hidden.device),
                           float32_head=getattr(head, "grpo_float32_head", False))


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                    entropy_grad: bool):
    """(logp, entropy or None), each (N, T), of logits (N, T, V); the entropy carries no graph unless
    `entropy_grad` (it is only logged then)."""
    logp = token_logprobs(logits, targets, temperature=temperature)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, token_entropy(logits if entropy_grad else logits.detach(), temperature=temperature)


def _packed_logprobs(model, packed: PackedRows, temperature: float, with_entropy: bool, tile_kernels,
                     entropy_grad: bool = False):
    """`completion_logprobs` through the packed layout: (n, width) log-probs (and entropies), 0 past each row's end.

    With a plain head, the decoder's hidden states at the scoring positions (n_tok, H) go through the tiled head;
    otherwise the model's forward returns logits at the columns holding a scoring position (`logits_to_keep`)."""
    head, inner = tiled_head(model)
    targets = packed.targets[None]  # (1, n_tok)
    if head is not None:
        hidden = packed_hidden(model, packed, inner)[None]  # (1, n_tok, H)
        logp, entropy = head_logprobs(hidden, head, inner, targets, temperature, with_entropy, tile_kernels)
    else:
        out = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask(_dtype(model, targets.device)),
                    position_ids=packed.position_ids, logits_to_keep=packed.keep_columns, use_cache=False,
                    **packed.attention_kwargs())
        logits = out.logits.reshape(-1, out.logits.shape[-1]).index_select(0, packed.kept_index)[None]  # (1, n_tok, V)
        logp, entropy = logits_logprobs(logits, targets, temperature, with_entropy, entropy_grad)
    logp = packed.unpack(logp[0])
    if not with_entropy:
        return logp
    return logp, packed.unpack(entropy[0] if entropy_grad else entropy[0].detach())


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float, with_entropy: bool = False, tile_kernels=None, entropy_grad: bool = False,
                        packed: PackedRows | None = None, images: list | None = None):
    """Log-probs (N, T) of the last T=completion_len tokens of each row under `model`, at the sampling temperature.

    input_ids (N, P+T): prompts left-padded to P, completions right-padded to T. Position j predicts token j+1, so
    the T completion tokens are predicted by positions P-1 .. P+T-2. With `with_entropy`, returns
    (logp, entropy (N, T), detached unless `entropy_grad`) instead.

    Fast path (a plain linear LM head, one process or DDP: `tiled_head`): the decoder's hidden states at those T
    positions go through `grpo.engines.head.hidden_logprobs`, which applies the head one cache-sized tile of positions x
    vocabulary at a time and recomputes each tile in backward, so the (N, T, V) logits and their gradient never
    exist (V is ~150k for real models). Without gradients (the reference pass) rows that share a prompt encode it once
    (`_shared_prompt_hidden`). Otherwise the model returns logits for just those positions (`logits_to_keep`),
    scored in chunks. `tile_kernels(dtype, device)`: the CPU engine's compiled tile kernels, or None.

    `packed`: the padding-free layout of these rows (`grpo.engines.packing.pack`); the passes then compute real
    tokens only, and the result is the same (N, T), 0 past each row's end.

    `images`: each row's image features (a vision-language model): the model's own forward takes them with the ids
    and computes its positions itself (M-RoPE), on the logits path.
    """
    if packed is not None:
        return _packed_logprobs(model, packed, temperature, with_entropy, tile_kernels, entropy_grad)
    targets = input_ids[:, -completion_len:]  # (N, T)
    head, inner = tiled_head(model) if images is None else (None, None)
    if head is not None:
        if inner is None:
            hidden = _completion_hidden(model, input_ids, attention_mask, completion_len)
        else:
            hidden = wrapped_hidden(model, inner, dict(
                input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], use_cache=False,
                position_ids=position_ids(attention_mask)[:, :-1]))[:, -completion_len:, :]
        logp, entropy = head_logprobs(hidden, head, inner, targets, temperature, with_entropy, tile_kernels)
        return (logp, entropy if entropy_grad else entropy.detach()) if with_entropy else logp
    extra = {} if images is None else _image_inputs(model, images, input_ids)
    if images is None or not own_positions(model):  # (M-RoPE models compute theirs from the images)
        extra["position_ids"] = position_ids(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion_len + 1, use_cache=False,
                **extra)
    logp, entropy = logits_logprobs(out.logits[:, :-1, :], targets, temperature, with_entropy, entropy_grad)
    zero = vision_zero(_base(model), images, input_ids.device) if images and torch.is_grad_enabled() else None
    if zero is not None:  # (no row here has an image: the vision side's zero gradients, gpu_review2 N6)
        logp = logp + zero
    return (logp, entropy) if with_entropy else logp


def _base(model):
    """The transformers model inside accelerate's wrapper (DDP) and peft's."""
    from accelerate.utils import extract_model_from_parallel

    base = extract_model_from_parallel(model)
    return base.get_base_model() if is_peft(base) else base


def _image_inputs(model, images: list, input_ids: torch.Tensor) -> dict:
    from grpo.engines.images import model_inputs

    return model_inputs(images, input_ids, _base(model).config)


def dropout_active(model) -> bool:
    """Whether the model's training-mode forward is random: a dropout module with p > 0 (LoRA's included) or an
    attention dropout in its config."""
    config = getattr(model, "config", None)
    return (any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
            or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0)


# Config attributes that change logits after the LM head; a model with any of them set takes the logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def tiled_head(model):
    """(the LM head, None) when the tiled head applies to `model` directly (`plain_head`); (the head, the wrapped
    module) for a DDP-wrapped model with a plain head: its forward runs through the wrapper and the tiled head on the
    hidden states, so the (N, T, V) logits and their gradient never exist there either (D12); (None, None) otherwise.

    FSDP2 and ZeRO-3 keep the logits path (`logits_to_keep`): their head's weight is whole only inside the wrapper's
    forward and backward, where their hooks gather it and reduce-scatter its gradient; a head applied outside would
    need its own gather and a gradient the wrappers do not reduce."""
    head = plain_head(model)
    if head is not None:
        return head, None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        head = plain_head(model.module)
        if head is not None and hasattr(model.module, "get_decoder"):
            return head, model.module
    return None, None


def plain_head(model):
    """The LM head when logits are exactly `hidden @ W.T + b` and calling the decoder directly is safe, else None.

    Not for a model wrapped by DDP, FSDP or DeepSpeed (their forward syncs or gathers), prompt-learning PEFT, a
    LoRA-wrapped head, or models that scale or cap logits after the head.
    """
    from accelerate.utils import extract_model_from_parallel

    if extract_model_from_parallel(model) is not model or not hasattr(model, "get_decoder") or sharding(model):
        return None  # DDP, FSDP, DeepSpeed: their forward must run (gradient sync, parameter gathering)
    if is_peft(model) and getattr(model.active_peft_config, "is_prompt_learning", False):
        return None  # prefix/prompt tuning acts in the PEFT model's own forward
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if type(head) is not torch.nn.Linear or any(getattr(config, k, None) not in (None, 1, 1.0)
                                                for k in _LOGIT_TRANSFORMS):
        return None
    return head
