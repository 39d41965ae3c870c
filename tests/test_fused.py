"""engines/cpu/fused.py: the compiled SwiGLU and RMSNorm passes against float64 torch, and a decoder switched to them against
the same decoder as transformers runs it (outputs and every parameter's gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from grpo.engines.cpu.fused import _RMSNorm, _SwiGLU, fuse_decoder_ops
from test_native import needs_compiler, tiny


def check_swiglu():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 7, 37, generator=gen, dtype=torch.float64) * 4  # 777 values: not a multiple of 16
    g[0, 0, :6] = torch.tensor([100.0, -100.0, 0.0, 88.5, -89.0, -1e-3])  # exp's limits and both signs
    u = torch.randn(3, 7, 37, generator=gen, dtype=torch.float64)
    dh = torch.randn(3, 7, 37, generator=gen, dtype=torch.float64)
    g32, u32 = g.float().requires_grad_(), u.float().requires_grad_()
    h = _SwiGLU.apply(g32, u32)
    h.backward(dh.float())
    g64, u64 = g.clone().requires_grad_(), u.clone().requires_grad_()
    expected = F.silu(g64) * u64
    expected.backward(dh)
    torch.testing.assert_close(h.double(), expected, atol=1e-5, rtol=2e-6)
    torch.testing.assert_close(g32.grad.double(), g64.grad, atol=1e-5, rtol=2e-6)
    torch.testing.assert_close(u32.grad.double(), u64.grad, atol=1e-5, rtol=2e-6)
    nan = _SwiGLU.apply(torch.tensor([float("nan"), 1.0]), torch.ones(2))
    assert nan[0].isnan() and nan[1] == pytest.approx(F.silu(torch.tensor(1.0)).item())


def check_rms_norm():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 40, generator=gen, dtype=torch.float64) * 3  # rows of 40: a partial 16-lane step
    w = torch.randn(40, generator=gen, dtype=torch.float64)
    dy = torch.randn(4, 5, 40, generator=gen, dtype=torch.float64)
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    y = _RMSNorm.apply(x32.transpose(0, 1), w32, 1e-6)  # a non-contiguous input
    y.backward(dy.transpose(0, 1).float())
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    expected.backward(dy)
    assert y.shape == (5, 4, 40)
    torch.testing.assert_close(y.transpose(0, 1).double(), expected, atol=1e-5, rtol=2e-6)
    torch.testing.assert_close(x32.grad.double(), x64.grad, atol=1e-5, rtol=2e-6)
    torch.testing.assert_close(w32.grad.double(), w64.grad, atol=1e-4, rtol=2e-6)
    frozen = _RMSNorm.apply(x32, w32.detach(), 1e-6)
    (grad_x,) = torch.autograd.grad(frozen.sum(), (x32,))  # a frozen weight (LoRA): no gradient asked of it
    assert torch.isfinite(grad_x).all()


@needs_compiler
def test_swiglu_and_rms_norm_match_float64_torch():
    check_swiglu()
    check_rms_norm()


@needs_compiler
@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral"])
def test_fused_decoder_trains_like_transformers(kind):
    """The switched decoder's hidden states and every parameter's gradient equal transformers' up to rounding, with
    left padding; a second switch changes nothing; bfloat16 activations take the modules' own forward."""
    plain = tiny(kind).train()
    fused = copy.deepcopy(plain)
    assert fuse_decoder_ops(fused) == 2 * 2 + 1 + 2  # 2 layers: two norms each, the final norm, 2 MLPs
    assert fuse_decoder_ops(fused) == 0
    torch.manual_seed(2)
    ids = torch.randint(1, 61, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    outs = []
    for model in (plain, fused):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        half = [m.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits for m in (plain, fused)]
    assert torch.equal(half[0], half[1])


@needs_compiler
def test_fuse_leaves_other_models_alone():
    gelu = tiny("llama")
    gelu.config.hidden_act = "gelu"
    assert fuse_decoder_ops(gelu) == 0
    from transformers import GPT2Config, GPT2LMHeadModel

    assert fuse_decoder_ops(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30))) == 0
