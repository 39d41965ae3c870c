"""The CPU engine's rollout: `TransformersSampler`'s loop with a compiled one-token step, head and draw.

For Llama-family models (`LeanDecoder.supports`) the one-token step is the lean step written out in torch, or one C
call per token where it applies (float32, one intra-op thread or small layers), and the LM head is packed once per
rollout (`packed_head`, into memory the update lends: `head_space`). Tokens are drawn by the compiled sampler
(csrc/softmax.c) for float32 logits. Every piece is checked against the plain sampler in tests.
"""

from __future__ import annotations

import torch

from grpo.engines import sampling
from grpo.engines.base import Completions, SamplingParams
from grpo.engines.cpu import native
from grpo.engines.cpu.decoding import LeanDecoder, packed_head
from grpo.engines.policy import plain_head


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`grpo.engines.sampling.sample_rows`, by the compiled sampler for float32 CPU logits where it is built. Its exps
    and sums round differently from torch's, so a uniform within ~1e-6 of a boundary can pick the neighbouring
    token."""
    lib = native.library() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None:
        return sampling.sample_rows(logits, uniforms)
    bad, tokens, logprobs = native.sample(lib, logits, uniforms)
    if bad >= 0:
        sampling._raise_no_mass(bad)
    return tokens, logprobs


class CPUSampler(sampling.TransformersSampler):
    def __init__(self, model, pad_id: int, eos_ids: list[int], batch_size: int | None = None):
        super().__init__(model, pad_id, eos_ids, batch_size)
        # Memory handed over for the next generate() call to pack the LM head into (packed_head's space): the
        # update's last head gradient, no longer needed (CPUBackend). Released when that call returns.
        self.head_space: torch.Tensor | None = None

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions:
        try:
            return super().generate(prompt_ids, params, seeds)
        finally:
            self.head_space = None

    def _draw(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_rows(logits, uniforms)

    def _decode_step(self, cache, rows: int, mask: torch.Tensor, p: SamplingParams):
        head = plain_head(self.model)
        if head is None or not LeanDecoder.supports(self.model):
            return None
        decoder = LeanDecoder(self.model)
        project = packed_head(head.weight, head.bias, rows, self.head_space)
        key_mask = None if bool(mask.all()) else torch.cat(
            [mask.bool(), torch.ones((rows, p.max_new_tokens), dtype=torch.bool, device=mask.device)], dim=1)
        return _Step(decoder.compiled(cache, rows) or decoder.hidden, project, cache, key_mask, mask.shape[1])


class _Step:
    """The CPU engine's one-token step: the decoder's step (compiled or lean), then the packed head; `keep(index)`
    drops the rows that have ended (the sampler has moved the cache's rows already)."""

    def __init__(self, hidden, project, cache, key_mask: torch.Tensor | None, width: int):
        self.hidden, self.project, self.cache, self.key_mask, self.width = hidden, project, cache, key_mask, width

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, t: int) -> torch.Tensor:
        visible = None if self.key_mask is None else self.key_mask[:, :self.width + t + 1]
        return self.project(self.hidden(tokens, positions, self.cache, visible))

    def keep(self, index: torch.Tensor) -> None:
        if self.key_mask is not None:
            self.key_mask = self.key_mask[index]
        if isinstance(self.hidden, native.CompiledStep):
            self.hidden.keep_rows(index.shape[0])
