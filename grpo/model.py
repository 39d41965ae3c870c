"""Loading the policy (and its reference) with `transformers` and `peft`, and its per-token log-probs.

The reference model exists only when beta > 0. With LoRA the reference is the same network with its adapters
disabled, so there is no second copy of the weights. Otherwise it is a frozen copy, kept in memory or, with
`reference_weights=disk`, in a safetensors file that each reference pass maps back in (`DiskReference`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import uuid
import weakref
from pathlib import Path

import torch

from grpo import native
from grpo.config import ConfigError, GRPOConfig
from grpo.core import hidden_logprobs, hidden_loss, token_entropy, token_logprobs
from grpo.decoding import distinct_rows, expand_cache, preallocated_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id is None:
        raise ConfigError(f"model_name_or_path: the tokenizer of {path!r} has no EOS token; completions could "
                          "never end. Set tokenizer.eos_token and save it.")
    if tok.pad_token_id is None:
        import warnings

        warnings.warn(f"the tokenizer of {path!r} has no pad token; using its EOS token for padding.")
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: GRPOConfig):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": DTYPES[cfg.torch_dtype]}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.load_in_4bit:
        if not torch.cuda.is_available():
            raise ConfigError("load_in_4bit: 4-bit (QLoRA) loading needs a CUDA GPU and bitsandbytes; this machine "
                              "has no GPU. Set load_in_4bit=false.")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    try:
        return AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, **kwargs)
    except OSError as err:
        raise ConfigError(f"model_name_or_path: cannot load {cfg.model_name_or_path!r}: {err}") from None


def lora_config(cfg: GRPOConfig):
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")


def prepare_model(model, cfg: GRPOConfig, peft_config=None, reference_dir: Path | None = None,
                  reference_prefix: str = ".reference-"):
    """Apply LoRA and gradient checkpointing; returns (policy, reference or None). With `reference_dir` the
    reference is a `DiskReference` whose weights wait in a file of that directory between passes."""
    if cfg.use_peft and peft_config is None:
        peft_config = lora_config(cfg)
    if peft_config is not None:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if cfg.load_in_4bit:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
        model = get_peft_model(model, peft_config)
    if cfg.gradient_checkpointing:
        kwargs = cfg.gradient_checkpointing_kwargs or {"use_reentrant": False}
        # transformers >= 5.23 names it activation_checkpointing_enable; the old name goes in v6
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    reference = None
    if cfg.beta > 0 and peft_config is None:
        if reference_dir is not None:
            reference = DiskReference(model, reference_dir, reference_prefix)
        else:
            reference = copy.deepcopy(model).eval()
            reference.requires_grad_(False)
    return model, reference


class DiskReference:
    """A frozen copy of `model` whose weights stay in a safetensors file except during a reference pass.

    The copy is built with zero-size parameters (its buffers, config and weight tying are real); `loaded()` maps
    the file's tensors in for one pass and drops them after, so the process holds the reference's weights only
    while it scores with them. Between passes they are the OS's file cache, which it may evict and re-read from
    disk. This is the CPU counterpart of verl's and OpenRLHF's reference offloading.

    The file, `<directory>/<prefix><pid>-<random>.safetensors`, is this object's own (two trainers on one output
    directory never share one), written atomically once from `model`'s weights, and deleted when this object is
    collected or at exit. Files left by processes that no longer run (a crash, kill -9) are deleted when the next
    one is made in the same directory.
    """

    def __init__(self, model, directory: str | Path, prefix: str = ".reference-"):
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _remove_orphans(directory, prefix)
        self.path = directory / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors"
        tmp = self.path.with_name(self.path.name + ".tmp")
        # named_parameters lists a tied weight once, under the name the copy will list it by too. Two parameters
        # that are one tensor under different objects are saved once (`aliases`); parts of one shared storage are
        # copied, since safetensors refuses to write tensors that overlap.
        tensors, self.aliases, seen, storages = {}, {}, {}, set()
        for name, p in model.named_parameters():
            key = (p.data_ptr(), p.dtype, tuple(p.shape), p.stride())
            if key in seen:
                self.aliases[name] = seen[key]
                continue
            seen[key] = name
            storage = p.untyped_storage().data_ptr()
            p = p.detach()
            tensors[name] = p.clone(memory_format=torch.contiguous_format) if storage in storages else p.contiguous()
            storages.add(storage)
        try:
            save_file(tensors, tmp)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not leave a partial copy of the model behind
            raise
        self._cleanup = weakref.finalize(self, _unlink, self.path)
        # Deep-copy everything but the weights: each parameter becomes an empty one (tied ones stay one object).
        memo = {id(p): torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=False)
                for p in model.parameters()}
        self.module = copy.deepcopy(model, memo).eval()
        self.params = dict(self.module.named_parameters())
        self.device = next(iter(self.params.values())).device if self.params else torch.device("cpu")

    def to(self, device) -> DiskReference:
        self.module.to(device)
        self.params = dict(self.module.named_parameters())  # .to may replace Parameter objects
        self.device = torch.device(device)
        return self

    @contextlib.contextmanager
    def loaded(self):
        """The reference module with its weights in place, for the duration of the block."""
        from safetensors.torch import load_file

        weights = load_file(self.path, device=str(self.device))
        try:
            for name, p in self.params.items():
                p.data = weights[self.aliases.get(name, name)]
            del weights
            yield self.module
        finally:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def close(self) -> None:
        """Delete the weights file now (the object is unusable after)."""
        self._cleanup()


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _remove_orphans(directory: Path, prefix: str) -> None:
    """Delete `prefix<pid>-*.safetensors[.tmp]` files in directory whose process is no longer running."""
    for path in directory.glob(f"{prefix}*.safetensors*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


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


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def reference_view(policy, reference):
    """The network that scores the reference log-probs: the frozen copy, or the policy with adapters off."""
    if isinstance(reference, DiskReference):
        with reference.loaded() as module:
            yield module
    elif reference is not None:
        yield reference
    elif is_peft(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise RuntimeError("reference_view: beta > 0 needs a reference model or a LoRA policy.")


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _completion_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int):
    """The decoder's final hidden states (N, T, H) at the positions that predict the last T tokens (P-1 .. P+T-2)."""
    if not torch.is_grad_enabled():  # (with gradients, sharing measured no faster on the benchmark's W1)
        shared = _shared_prompt_hidden(model, input_ids, attention_mask, completion_len)
        if shared is not None:
            return shared
    # The last token predicts nothing: it is left out.
    out = model.get_decoder()(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                              position_ids=_positions(attention_mask)[:, :-1], use_cache=False)
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
    positions = _positions(attention_mask)
    decoder = model.get_decoder()
    head = decoder(input_ids=input_ids[first, :prompt_len], attention_mask=attention_mask[first, :prompt_len],
                   position_ids=positions[first, :prompt_len], use_cache=True, past_key_values=cache)
    if not all(layer.is_initialized for layer in cache.layers):
        return None  # the model declined the cache (gradient checkpointing in training mode, e.g. a LoRA reference)
    expand_cache(cache, copies)
    tail = decoder(input_ids=input_ids[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
                   position_ids=positions[:, prompt_len:-1], use_cache=True, past_key_values=cache)
    return torch.cat([head.last_hidden_state[copies, -1:], tail.last_hidden_state], dim=1).contiguous()


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                        temperature: float, with_entropy: bool = False):
    """Log-probs (N, T) of the last T=completion_len tokens of each row under `model`, at the sampling temperature.

    input_ids (N, P+T): prompts left-padded to P, completions right-padded to T. Position j predicts token j+1, so
    the T completion tokens are predicted by positions P-1 .. P+T-2. With `with_entropy`, returns
    (logp, entropy (N, T), detached) instead.

    Fast path (a plain linear LM head, one process): the decoder's hidden states at those T positions go through
    `grpo.core.hidden_logprobs`, which applies the head one cache-sized tile of positions x vocabulary at a time and
    recomputes each tile in backward, so the (N, T, V) logits and their gradient never exist (V is ~150k for real
    models). Without gradients (the reference pass) rows that share a prompt encode it once
    (`_shared_prompt_hidden`). Otherwise the model returns logits for just those positions (`logits_to_keep`),
    scored in chunks.
    """
    targets = input_ids[:, -completion_len:]  # (N, T)
    head = plain_head(model)
    if head is not None:
        hidden = _completion_hidden(model, input_ids, attention_mask, completion_len)
        # The head's weight gradient goes straight into .grad (no (V, H) temporary per micro-batch): safe here, the
        # trainer calls .backward() on an unwrapped model.
        logp, entropy = hidden_logprobs(hidden, head.weight, targets, temperature=temperature, bias=head.bias,
                                        with_entropy=with_entropy, weight_grad_in_place=head.weight.is_leaf,
                                        kernels=native.tile_kernels(hidden.dtype, hidden.device))
        return (logp, entropy.detach()) if with_entropy else logp
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask),
                logits_to_keep=completion_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :]  # (N, T, V)
    logp = token_logprobs(logits, targets, temperature=temperature)
    if not with_entropy:
        return logp
    with torch.no_grad():
        return logp, token_entropy(logits.detach(), temperature=temperature)


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
                    logp_estimate: torch.Tensor | None = None, weight_grad_storage: torch.Tensor | None = None):
    """The loss `row_loss(logp rows, rows)` summed over the rows of this micro-batch, with its gradient formed in the
    same pass as the log-probs (`grpo.core.hidden_loss`: the LM head applied three times instead of four).

    Rows are scored a few at a time into a buffer of their full logits, capped at _FUSED_ELEMENTS
    (_FUSED_ELEMENTS_FROZEN_HEAD for a frozen head). When the buffer cannot hold every row at once and
    `logp_estimate` (N, T) is given (the sampler's log-probs of these tokens, or for a frozen head any close
    estimate), every row goes through one pass over the vocabulary with no buffer instead (hidden_loss's
    logp_estimate).

    `weight_grad_storage`: memory of the head weight's shape for its gradient when `.grad` is None (hidden_loss's
    weight_grad_storage), or None.

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
    hidden = _completion_hidden(model, input_ids, attention_mask, completion_len)
    return hidden_loss(hidden, head.weight, input_ids[:, -completion_len:], row_loss, temperature, bias=head.bias,
                       with_entropy=with_entropy, rows_per_chunk=max(1, cap // per_row),
                       weight_grad_in_place=head.weight.is_leaf,
                       kernels=native.tile_kernels(hidden.dtype, hidden.device), logp_estimate=logp_estimate,
                       weight_grad_storage=weight_grad_storage if head.weight.is_leaf else None)


def dropout_active(model) -> bool:
    """Whether the model's training-mode forward is random: a dropout module with p > 0 (LoRA's included) or an
    attention dropout in its config."""
    config = getattr(model, "config", None)
    return (any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
            or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0)


# Config attributes that change logits after the LM head; a model with any of them set takes the logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def plain_head(model):
    """The LM head when logits are exactly `hidden @ W.T + b` and calling the decoder directly is safe, else None.

    Not for a model wrapped by DDP, FSDP or DeepSpeed (their forward syncs or gathers), prompt-learning PEFT, a
    LoRA-wrapped head, or models that scale or cap logits after the head.
    """
    from accelerate.utils import extract_model_from_parallel

    if extract_model_from_parallel(model) is not model or not hasattr(model, "get_decoder"):
        return None  # DDP, FSDP, DeepSpeed: their forward must run (gradient sync, parameter gathering)
    if is_peft(model) and getattr(model.active_peft_config, "is_prompt_learning", False):
        return None  # prefix/prompt tuning acts in the PEFT model's own forward
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if type(head) is not torch.nn.Linear or any(getattr(config, k, None) not in (None, 1, 1.0)
                                                for k in _LOGIT_TRANSFORMS):
        return None
    return head


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The weights a checkpoint must hold: the adapters for LoRA, everything otherwise."""
    if is_peft(model):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return model.state_dict()


def load_trainable_state(model, weights: dict[str, torch.Tensor]) -> None:
    if is_peft(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)
    else:
        model.load_state_dict(weights)


def save_final(model, tokenizer, path, merge: bool) -> None:
    """Hugging Face format that `AutoModelForCausalLM.from_pretrained(path)` loads; adapters also kept."""
    path = Path(path)
    if is_peft(model):
        model.save_pretrained(path / "adapter")
        if merge:
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(path)
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
