"""Loading the policy (and its reference) with `transformers` and `peft`, and saving what training made.

The reference model exists only when beta > 0. With LoRA the reference is the same network with its adapters
disabled, so there is no second copy of the weights. Otherwise it is a frozen copy, kept in memory or, with
`reference_weights=disk` (the CPU engine's default), in a safetensors file that each reference pass maps back in
(`grpo.engines.cpu.reference.DiskReference`).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.config.derived import needs_reference
from grpo.engines.cpu.reference import DiskReference
from grpo.engines.images import is_vision_config
from grpo.engines.policy import is_peft
from grpo.engines.sharding import sharding
from grpo.training.data.vision import vision_modules

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


# The files a tokenizer is read from (one is enough); without any, transformers builds an empty tokenizer from
# config.json, and the run fails minutes later in a reshape of 0 elements.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(path: str, cfg: GRPOConfig | None = None):
    from transformers import AutoTokenizer

    local = Path(path).expanduser()
    if (local.is_dir() and not (local / "adapter_config.json").exists()
            and not any((local / name).exists() for name in TOKENIZER_FILES)):
        raise ConfigError(f"model_name_or_path: {path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, "
                          "...); save the model's tokenizer there (tokenizer.save_pretrained), or pass "
                          "processing_class.")
    kwargs = {} if cfg is None else {"revision": cfg.model_revision, "trust_remote_code": cfg.trust_remote_code}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    if cfg is not None and cfg.chat_template is not None:
        tok.chat_template = cfg.chat_template  # open-r1's key: the recipe's template replaces the tokenizer's
    if tok.eos_token_id is None:
        raise ConfigError(f"model_name_or_path: the tokenizer of {path!r} has no EOS token; completions could "
                          "never end. Set tokenizer.eos_token and save it.")
    if tok.pad_token_id is None:
        import warnings

        warnings.warn(f"the tokenizer of {path!r} has no pad token; using its EOS token for padding.")
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: GRPOConfig, quantization_config=None):
    """The policy from model_name_or_path; model_init_kwargs (TRL's) are passed on and win over the separate keys.
    A vision-language config (one with a vision_config) loads with AutoModelForImageTextToText, as TRL loads it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = {"dtype": DTYPES[cfg.torch_dtype], "revision": cfg.model_revision,
              "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if quantization_config is None and cfg.load_in_4bit:
        if not torch.cuda.is_available():
            raise ConfigError("load_in_4bit: 4-bit (QLoRA) loading needs a CUDA GPU and bitsandbytes; this machine "
                              "has no GPU. Set load_in_4bit=false.")
        from transformers import BitsAndBytesConfig

        quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
                                                 bnb_4bit_use_double_quant=cfg.use_bnb_nested_quant,
                                                 bnb_4bit_compute_dtype=torch.bfloat16)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    extra = dict(cfg.model_init_kwargs or {})
    if "torch_dtype" in extra:
        extra["dtype"] = extra.pop("torch_dtype")
    kwargs.update(extra)
    try:
        config = AutoConfig.from_pretrained(cfg.model_name_or_path, revision=cfg.model_revision,
                                            trust_remote_code=cfg.trust_remote_code)
        auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
        return auto.from_pretrained(cfg.model_name_or_path, **kwargs)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"model_name_or_path: cannot load {cfg.model_name_or_path!r}: {err}") from None


def lora_config(cfg: GRPOConfig, model=None):
    """The LoRA config of the recipe's keys; with freeze_vision_tower, no adapters on `model`'s vision side."""
    from peft import LoraConfig

    frozen = vision_modules(model) if cfg.freeze_vision_tower and model is not None else []
    exclude = "|".join(rf"{re.escape(name)}\..*" for name in frozen) or None  # (a regex: each module's insides)
    wanted_names = cfg.lora_target_parameters if model is not None else None
    names = [n for n, _ in model.named_parameters()] if wanted_names else []
    for wanted in wanted_names or []:  # (peft skips a name it lacks)
        if not any(n == wanted or n.endswith("." + wanted) for n in names):
            raise ConfigError(f"lora_target_parameters: {type(model).__name__} has no parameter {wanted!r} (an MoE's "
                              "stacked experts are e.g. mlp.experts.gate_up_proj); name parameters it has.")
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, modules_to_save=cfg.lora_modules_to_save,
                      target_parameters=cfg.lora_target_parameters,
                      use_rslora=cfg.use_rslora, use_dora=cfg.use_dora, task_type="CAUSAL_LM",
                      exclude_modules=exclude)


def freeze_vision(model) -> None:
    """freeze_vision_tower: no parameter of the vision side (adapters included) takes a gradient."""
    base = model.get_base_model() if is_peft(model) else model
    names = vision_modules(base)
    if not names:
        raise ConfigError("freeze_vision_tower: the model is not a vision-language model (no vision_config), so it "
                          "has no vision tower to freeze; remove the key.")
    for name in names:
        base.get_submodule(name).requires_grad_(False)


def prepare_model(model, cfg: GRPOConfig, peft_config=None, reference_dir: Path | None = None,
                  reference_prefix: str = ".reference-"):
    """Apply LoRA and gradient checkpointing; returns (policy, reference or None). With `reference_dir` the
    reference is a `DiskReference` whose weights wait in a file of that directory between passes."""
    if cfg.use_peft and peft_config is None:
        peft_config = lora_config(cfg, model)
    if cfg.use_liger_kernel:
        apply_liger_kernels(model)
    if peft_config is not None:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if cfg.load_in_4bit:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
        model = get_peft_model(model, peft_config)
    if cfg.freeze_vision_tower:
        freeze_vision(model)
    if cfg.disable_dropout:  # (after LoRA: its dropout too, as TRL disables it)
        disable_dropout(model)
    if cfg.gradient_checkpointing:
        kwargs = cfg.gradient_checkpointing_kwargs or {"use_reentrant": False}
        # transformers >= 5.23 names it activation_checkpointing_enable; the old name goes in v6
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    if cfg.cast_lm_head_to_fp32:  # (before the reference is copied from the policy: it gets the same head)
        cast_lm_head_to_fp32(model)
    if peft_config is not None and cfg.sync_ref_model:
        raise ConfigError("sync_ref_model: with LoRA the reference is the model with its adapters off, nothing to "
                          "sync (TRL refuses it too); train all weights or turn it off.")
    reference = None
    if needs_reference(cfg) and peft_config is None:
        if reference_dir is not None and not cfg.sync_ref_model:  # (a synced reference changes: kept in memory)
            reference = disk_reference(model, reference_dir, reference_prefix)
        else:
            reference = reference_copy(model, cfg).eval()
            reference.requires_grad_(False)
            if cfg.cast_lm_head_to_fp32 and not getattr(reference.get_output_embeddings(), "grpo_float32_head", 0):
                cast_lm_head_to_fp32(reference)  # (loaded again under ZeRO-3, not copied)
    return model, reference


def disk_reference(model, directory: Path, prefix: str) -> DiskReference:
    """A DiskReference; a file that cannot be written (a full disk) is SaveFailed naming it and what to do."""
    from grpo.training.checkpoint.files import free_space
    from grpo.training.run.errors import SaveFailed

    try:
        return DiskReference(model, directory, prefix)
    except Exception as err:  # noqa: BLE001 - a full disk: OSError, or safetensors' SafetensorError
        reason = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
        raise SaveFailed(f"could not write the reference model's weights (reference_weights: disk) into "
                         f"{directory}: {reason}{free_space(directory)}. Free space there, or keep the reference in "
                         "memory: reference_weights=memory.") from err


def reference_copy(model, cfg: GRPOConfig):
    """A frozen copy of `model` (loaded, not yet prepared) for the reference. Weights that DeepSpeed's ZeRO-3
    partitioned as they loaded (zero3_init_flag) cannot be copied: the reference loads them again from
    model_name_or_path."""
    if sharding(model) != "zero3":
        return copy.deepcopy(model)
    if getattr(model, "name_or_path", None) != cfg.model_name_or_path:
        raise ConfigError("model_name_or_path: under DeepSpeed ZeRO-3 the reference model is loaded from the "
                          "policy's path; pass the model as a path (not a loaded model), or set beta=0.")
    return load_model(cfg)


def _float32_linear(self, hidden: torch.Tensor) -> torch.Tensor:
    """An LM head's forward in float32 with autocast off: (..., V) float32 logits (TRL's cast_lm_head_to_fp32)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.float(), self.weight.float(),
                                          None if self.bias is None else self.bias.float())


def cast_lm_head_to_fp32(model) -> None:
    """TRL's `cast_lm_head_to_fp32` on `model` (the policy or the reference): the LM head's weight cast to float32
    and its forward taken in float32 with autocast off; tied input embeddings, whose weight that is too, give their
    outputs in the model's dtype again. `grpo_float32_head` tells the tiled head (`grpo.engines.head.hidden_logprobs`) to do
    the same. A LoRA adapter on the head is refused, as TRL refuses it."""
    import types

    base = model.get_base_model() if is_peft(model) else model
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        kind = f"{type(head).__module__}.{type(head).__name__}"
        raise ConfigError(f"cast_lm_head_to_fp32: the LM head is a {kind}, not a torch.nn.Linear (a LoRA adapter on "
                          "it?); remove lm_head from lora_target_modules and lora_modules_to_save, or set "
                          "cast_lm_head_to_fp32 false.")
    dtype = head.weight.dtype
    head.float()
    head.forward = types.MethodType(_float32_linear, head)  # (a bound method: a deep copy binds to the copy's head)
    head.grpo_float32_head = True
    embedding = base.get_input_embeddings()
    if embedding is not None and embedding.weight is head.weight and dtype != torch.float32:
        embedding.register_forward_hook(lambda module, args, output: output.to(dtype))


def disable_dropout(model) -> None:
    """Every dropout off (TRL's disable_dropout): the update's log-probs then equal sampling's."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "attention_dropout", None):
        config.attention_dropout = 0.0


def apply_liger_kernels(model) -> None:
    """Liger's layer kernels (RMSNorm, RoPE, SwiGLU), as TRL applies them: not its fused cross-entropy, which would
    replace the LM head grpo reads its log-probs from."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        raise ConfigError("use_liger_kernel: liger-kernel is not installed (pip install liger-kernel; its kernels "
                          "need a CUDA GPU). Set use_liger_kernel=false.") from None
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, cross_entropy=False)


def save_model_files(model, tokenizer, path) -> None:
    """What save_pretrained writes (config.json and model.safetensors, or for LoRA adapter_config.json and
    adapter_model.safetensors) and the tokenizer: a directory from_pretrained loads. Tensors keep their dtype."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def load_model_files(model, path) -> None:
    """The weights of `save_model_files` back into `model`, exactly: the adapters for LoRA, every tensor otherwise (a
    tied weight, written once, comes back through the tensor it is tied to)."""
    from grpo.training.checkpoint.files import model_weights

    if not is_peft(model) and is_vision_config(model.config):
        # A vision-language model's files name its weights as the hub does (`visual.*`, `model.layers.*`), not as
        # its modules do (`model.visual.*`, `model.language_model.*`): transformers' loader maps them back.
        from transformers import AutoModelForImageTextToText

        weights = AutoModelForImageTextToText.from_pretrained(path, dtype=next(model.parameters()).dtype).state_dict()
    else:
        weights = model_weights(path, adapters=is_peft(model))
    if is_peft(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected and not is_peft(model):
        # Files whose names transformers converts on load (an MoE's experts, one tensor each on disk, stacked in the
        # model): its loader maps them back, exactly (stacking and splitting copy the values).
        weights = type(model).from_pretrained(path, dtype=next(model.parameters()).dtype).state_dict()
        missing, unexpected = model.load_state_dict(weights, strict=False)
    loaded = {p.data_ptr() for name, p in model.state_dict().items() if name in weights}
    untied = [name for name in missing if model.state_dict()[name].data_ptr() not in loaded]
    if unexpected or untied:
        raise ValueError(f"checkpoint {path}: its weights do not fit the model (unexpected {unexpected[:3]}, "
                         f"missing {untied[:3]}).")


def save_final(model, tokenizer, path, merge: bool, adapter_dir: str = "adapter") -> None:
    """Hugging Face format that `AutoModelForCausalLM.from_pretrained(path)` loads; with LoRA the adapter in
    `path/adapter_dir` and, with `merge`, the merged model at `path` (final/). `adapter_dir=""` with merge off is
    TRL's save_model: the adapter at `path`, which `PeftModel.from_pretrained(base, path)` loads. A write that
    fails (a full disk) is SaveFailed, naming the path and the newest checkpoint, which is intact."""
    from grpo.training.checkpoint.files import writing

    with writing(path) as into:  # (written beside `path`, moved into it once whole)
        if is_peft(model):
            model.save_pretrained(into / adapter_dir)
            if merge:
                merged = copy.deepcopy(model).merge_and_unload()
                merged.save_pretrained(into)
        else:
            model.save_pretrained(into)
        tokenizer.save_pretrained(into)
