"""The operations' plain formulas: norms, the SwiGLU gate and RoPE, with their hand-written backwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raytrm.models.layers import RotaryEmbedding
from raytrm.models.ops import _AddRMSNorm, _RMSNorm, add_rms_norm, apply_rotary, rms_norm, swiglu_gate


def test_rms_norm_has_no_scale_and_computes_in_fp32():
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms_norm(x, 1e-5), expected)
    torch.testing.assert_close(rms_norm(x, 1e-5, dim=0), x / torch.sqrt(x.pow(2).mean(0, keepdim=True) + 1e-5))
    xb = x.bfloat16()
    out = rms_norm(xb, 1e-5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, rms_norm(xb.float(), 1e-5).bfloat16())


@pytest.mark.parametrize("dim", [-1, 0])
def test_fused_add_rms_norm_equals_the_formula_and_passes_gradcheck(dim):
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    f = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    fused = _AddRMSNorm.apply(x, f, 1e-5, dim)
    plain = rms_norm(x + f, 1e-5, dim)
    torch.testing.assert_close(fused, plain)
    g = torch.randn_like(fused)
    assert torch.autograd.gradcheck(lambda a, b: _AddRMSNorm.apply(a, b, 1e-5, dim), (x, f))
    fused_grads = torch.autograd.grad(fused, (x, f), g)
    plain_grads = torch.autograd.grad(plain, (x, f), g)
    for mine, theirs in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs)


def test_add_rms_norm_keeps_half_precision_on_the_plain_formula():
    x, f = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    out = add_rms_norm(x, f, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, rms_norm(x + f, 1e-5))


@pytest.mark.parametrize("dim", [-1, 0])
def test_swiglu_gate_equals_silu_times_up_and_passes_gradcheck(dim):
    gate_up = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    gate, up = gate_up.chunk(2, dim)
    torch.testing.assert_close(swiglu_gate(gate_up, dim), F.silu(gate) * up)
    assert torch.autograd.gradcheck(lambda t: swiglu_gate(t, dim), (gate_up,))


def test_fused_rotary_equals_rotate_half_and_passes_gradcheck():
    rope = RotaryEmbedding(8, 5, 10000.0)
    cos, sin = (t.double()[:, None] for t in rope())
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    x1, x2 = x.chunk(2, dim=-1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), x * cos + torch.cat((-x2, x1), dim=-1) * sin)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))
    # A strided input (q and k are slices of the fused projection) rotates the same as a contiguous copy.
    wide = torch.randn(5, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary(wide[..., 4:12], cos, sin), apply_rotary(wide[..., 4:12].clone(), cos, sin))


def _plain_rms_norm(x, eps, dim):
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(dim, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dim", [-1, 0])
def test_rms_norm_equals_the_plain_formula_with_its_gradient(dim):
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(rms_norm(x, 1e-5, dim), _plain_rms_norm(x, 1e-5, dim))
    assert torch.autograd.gradcheck(lambda t: _RMSNorm.apply(t, 1e-5, dim), (x,))
    # Half precision: the output is the fp32 formula's rounded once, the gradient the plain formula's.
    xb = torch.randn(64, 48).bfloat16().requires_grad_()
    g = torch.randn(64, 48).bfloat16()
    ours, plain = rms_norm(xb, 1e-5, dim), _plain_rms_norm(xb, 1e-5, dim)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, plain)
    (grad,) = torch.autograd.grad(ours, xb, g)
    (expected,) = torch.autograd.grad(plain, xb, g)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, expected)


def test_half_precision_rotary_is_the_fp32_formula_rounded_once_with_its_gradient():
    cos, sin = (t[:, None] for t in RotaryEmbedding(16, 7, 10000.0)())
    x = torch.randn(7, 3, 16).bfloat16().requires_grad_()
    g = torch.randn(7, 3, 16).bfloat16()
    h = x.float()
    h1, h2 = h.chunk(2, dim=-1)
    plain = (h * cos + torch.cat((-h2, h1), dim=-1) * sin).bfloat16()
    ours = apply_rotary(x, cos, sin)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, plain)
    (grad,) = torch.autograd.grad(ours, x, g)
    (expected,) = torch.autograd.grad(plain, x, g)
    torch.testing.assert_close(grad, expected)
