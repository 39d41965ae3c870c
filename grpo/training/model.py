"""Loading the policy (and its reference) with `transformers` and `peft`, and saving what training made.

The reference model exists only when beta > 0. With LoRA the reference is the same network with its adapters
disabled, so there is no second copy of the weights. Otherwise it is a frozen copy, kept in memory or, with
`reference_weights=disk` (the CPU engine's default), in a safetensors file that each reference pass maps back in
(`grpo.engines.cpu.reference.DiskReference`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.engines.cpu.reference import DiskReference
from grpo.engines.policy import is_peft
from grpo.engines.sharding import sharding

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
            reference = reference_copy(model, cfg).eval()
            reference.requires_grad_(False)
    return model, reference


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
