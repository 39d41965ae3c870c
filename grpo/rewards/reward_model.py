"""A learned reward: any `AutoModelForSequenceClassification` checkpoint, called like a TRL reward function.

As TRL's `GRPOTrainer` does for a model given in `reward_funcs`: the reward model has its own tokenizer; a
conversational prompt and completion go through that tokenizer's chat template, anything else is concatenated as
text; the score is `logits[:, 0]`, computed under `inference_mode` in batches.
"""

import os
from typing import Any

import torch

from .text import completion_text, prompt_text


class RewardModel:
    """Score (prompt, completion) pairs with a sequence-classification model from a local directory.

    Args:
        path: checkpoint directory (`config.json` + weights), or the loaded model itself (TRL's form).
        tokenizer: tokenizer directory or loaded tokenizer, if not the checkpoint's own.
        batch_size: pairs per forward pass.
        device: where the model runs ("cpu", "cuda", "cuda:1", ...); None: the device this process trains on (its
            own GPU under DDP, as TRL prepares reward models; the CPU on a CPU run), else the machine's
            accelerator. A device without an index is this process's device of that kind, fixed at construction
            (a reward thread would otherwise take cuda:0).
        dtype: the weights' dtype ("float32", "bfloat16", "float16", "auto": the checkpoint's); None: bfloat16 on
            an accelerator (the compute dtype of a bf16 run; float16 on a GPU without bf16), float32 on the CPU.
        max_length: truncate longer inputs to this many tokens (None: no truncation).
    """

    def __init__(
        self,
        path: Any,
        tokenizer: Any = None,
        batch_size: int = 8,
        device: str | None = None,
        max_length: int | None = None,
        dtype: str | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"RewardModel: batch_size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self.max_length = max_length
        if isinstance(path, torch.nn.Module):  # a loaded model: it stays where it is
            self.model = path.eval()
            self.path = getattr(path.config, "_name_or_path", "") or type(path).__name__
            self.device = next(path.parameters()).device
        else:
            self.path = path
            self.device, dtype = placement(device, dtype)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.__name__ = os.path.basename(os.path.normpath(self.path))
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or self.path)
        self.tokenizer = tokenizer
        if self.tokenizer.pad_token is None:
            # TRL does the same: batching needs a pad token, and the eos token is the usual stand-in.
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.tokenizer.pad_token is None:
            raise ValueError(f"reward model {path!r}: its tokenizer has neither a pad token nor an eos token")
        # The model finds each sequence's last real token by comparing with pad_token_id. A pad token outside the
        # vocabulary (a tokenizer given one it does not have, as TRL's tests do) has no id, or an id past the model's
        # embeddings: each batch is then padded with an id none of its rows contains (_score_own_padding).
        pad_id, rows = self.tokenizer.pad_token_id, getattr(self.model.config, "vocab_size", None)
        self.own_padding = pad_id is None or (rows is not None and pad_id >= rows)  # (added past the embeddings)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        """(B*G,) prompts and completions in, (B*G,) scores out."""
        texts = [self.text(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            scores.extend(self._score(texts[start : start + self.batch_size]))
        return scores

    def text(self, prompt: Any, completion: Any) -> str:
        """The text the reward model reads for one pair."""
        if isinstance(prompt, list) and self.tokenizer.chat_template:
            reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(prompt + reply, tokenize=False)
        return prompt_text(prompt) + completion_text(completion)

    @torch.inference_mode()
    def _score(self, texts: list[str]) -> list[float]:
        if self.own_padding:
            return self._score_own_padding(texts)
        # Special tokens come from the chat template (or are absent on purpose), as in TRL.
        batch = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
            truncation=self.max_length is not None,
            max_length=self.max_length,
        )
        # Only these two: some tokenizers also return token_type_ids, which decoder models do not accept.
        logits = self.model(
            input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device)
        ).logits  # (b, num_labels)
        return logits[:, 0].float().tolist()


    @torch.inference_mode()
    def _score_own_padding(self, texts: list[str]) -> list[float]:
        """Right-padded with the smallest id no row of the batch contains, so the model's last-real-token search
        (by pad_token_id) finds each row's true end."""
        rows = self.tokenizer(texts, add_special_tokens=False, truncation=self.max_length is not None,
                              max_length=self.max_length)["input_ids"]
        used = {t for row in rows for t in row}
        pad = next(i for i in range(len(used) + 1) if i not in used)
        width = max(len(row) for row in rows)
        ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows], device=self.device)
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows], device=self.device)
        self.model.config.pad_token_id = pad
        return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()


def placement(device: str | None, dtype: str | None) -> tuple[torch.device, Any]:
    """(device, dtype) a reward model loads to (RewardModel's `device` and `dtype`): by default this process's
    accelerator in a 16-bit dtype, never cuda:0 for every process, nor the CPU in float32 on a GPU run."""
    if device is None:
        device = _run_device()
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:  # (this process's device: accelerate has set it)
        device = torch.device(device.type, torch.accelerator.current_device_index())
    if dtype is not None:
        return device, dtype if dtype == "auto" else getattr(torch, dtype)
    if device.type == "cpu":
        return device, torch.float32
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    return device, torch.bfloat16 if bf16 else torch.float16


def _run_device() -> torch.device:
    """The device this process trains on: accelerate's, once the trainer's Accelerator exists (the CPU for a CPU
    run on a GPU host, whose forks must not follow a CUDA initialisation), else the machine's accelerator."""
    from accelerate.state import AcceleratorState, is_initialized

    if is_initialized():
        return AcceleratorState().device
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
