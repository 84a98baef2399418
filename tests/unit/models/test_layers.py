"""Shared layers: inits, widths, norms, RoPE, attention and the sparse embedding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from raytrm.models.layers import (
    Attention,
    Embedding,
    Linear,
    RotaryEmbedding,
    SparseEmbedding,
    SwiGLU,
    _AddRMSNorm,
    _RMSNorm,
    _SmallTableLookup,
    add_rms_norm,
    apply_rotary,
    mix_columns_in_blocks,
    rms_norm,
    swiglu_gate,
    swiglu_width,
    trunc_normal_,
)


def test_trunc_normal_has_the_requested_std_within_two_sigma():
    torch.manual_seed(0)
    x = trunc_normal_(torch.empty(400_000), std=0.5)
    assert abs(x.std().item() - 0.5) < 0.005
    assert abs(x.mean().item()) < 0.005
    # Truncated at 2 sigma of the underlying normal, whose sigma is a little above the requested std.
    assert x.abs().max() <= 2 * 0.5 / math.sqrt(0.7737413) + 1e-6
    assert not trunc_normal_(torch.ones(5), std=0).any()


@pytest.mark.parametrize(("hidden", "expansion", "width"), [(512, 4, 1536), (97, 4, 512), (256, 4, 768), (64, 4, 256)])
def test_swiglu_width_rule(hidden, expansion, width):
    assert swiglu_width(hidden, expansion) == width


def test_rms_norm_has_no_scale_and_computes_in_fp32():
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms_norm(x, 1e-5), expected)
    torch.testing.assert_close(rms_norm(x, 1e-5, dim=0), x / torch.sqrt(x.pow(2).mean(0, keepdim=True) + 1e-5))
    xb = x.bfloat16()
    out = rms_norm(xb, 1e-5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, rms_norm(xb.float(), 1e-5).bfloat16())


def test_linear_init_and_cast():
    torch.manual_seed(0)
    layer = Linear(1024, 512)
    assert layer.bias is None
    assert abs(layer.weight.std().item() - 1024**-0.5) < 1e-3
    biased = Linear(4, 2, bias=True)
    assert not biased.bias.any()
    x = torch.randn(2, 1024, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16 and layer.weight.dtype == torch.float32


def test_swiglu_columns_is_the_transposed_map():
    torch.manual_seed(0)
    mlp = SwiGLU(13, 4.0)
    x = torch.randn(13, 40)
    torch.testing.assert_close(mlp.forward_columns(x), mlp(x.T).T, rtol=1e-5, atol=1e-6)
    assert mlp.gate_up_proj.weight.shape == (2 * 256, 13) and mlp.down_proj.weight.shape == (13, 256)


def test_rotary_matches_rotate_half_and_leaves_position_zero():
    rope = RotaryEmbedding(head_dim=8, max_positions=6, theta=10000.0)
    cos, sin = rope()
    assert cos.shape == (6, 8) and "cos" not in rope.state_dict()
    x = torch.randn(2, 6, 3, 8)  # [B, L, heads, head_dim]
    out = apply_rotary(x, cos[:, None], sin[:, None])
    torch.testing.assert_close(out[:, 0], x[:, 0])
    # Position p, frequency i: the pair (x_i, x_{i+4}) turns by p * theta^(-2i/8).
    p, i = 3, 1
    angle = p * 10000.0 ** (-2 * i / 8)
    a, b = x[:, p, :, i], x[:, p, :, i + 4]
    torch.testing.assert_close(out[:, p, :, i], a * math.cos(angle) - b * math.sin(angle))
    torch.testing.assert_close(out[:, p, :, i + 4], b * math.cos(angle) + a * math.sin(angle))


def _explicit_attention(x, attn, rope, causal):
    B, L, D = x.shape
    H, hd = attn.num_heads, attn.head_dim
    q, k, v = (x @ attn.qkv_proj.weight.T).view(B, L, 3, H, hd).unbind(2)
    if rope is not None:
        q, k = apply_rotary(q, rope[0][:, None], rope[1][:, None]), apply_rotary(k, rope[0][:, None], rope[1][:, None])
    scores = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(hd)
    if causal:
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v).reshape(B, L, D)
    return out @ attn.o_proj.weight.T


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_rope", [False, True])
def test_attention_matches_explicit_softmax(causal, use_rope):
    torch.manual_seed(0)
    attn = Attention(32, 4, causal=causal)
    rope = RotaryEmbedding(8, 7, 10000.0)() if use_rope else None
    x = torch.randn(2, 7, 32)
    expected = _explicit_attention(x, attn, rope, causal)
    torch.testing.assert_close(attn(x, rope), expected, rtol=1e-5, atol=1e-5)
    assert attn.qkv_proj.weight.shape == (96, 32) and attn.qkv_proj.bias is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_small_tables_lookup_takes_its_gradient_as_a_product_equal_to_embeddings(dtype):
    """_SmallTableLookup (the table's gradient as onehot(ids)^T @ grad, what Embedding runs on CUDA) gives
    F.embedding's rows, and the table's gradient as F.embedding's in fp64 rounded once to the dtype (summed in fp32,
    within fp32's rounding of it); rows no id looks up get exact zeros."""
    torch.manual_seed(0)
    table = torch.randn(11, 64).to(dtype).requires_grad_()
    ids = torch.randint(0, 10, (6, 81))  # row 10 never looked up
    grad = torch.randn(6, 81, 64).to(dtype)
    rows = _SmallTableLookup.apply(ids, table)
    assert torch.equal(rows, F.embedding(ids, table))
    rows.backward(grad)
    exact = table.detach().double().requires_grad_()
    F.embedding(ids, exact).backward(grad.double())
    assert table.grad.dtype == dtype and not table.grad[10].any()
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2**-8, "atol": 1e-3}
    torch.testing.assert_close(table.grad.double(), exact.grad, **tolerance)


def test_embedding_looks_up_the_table_cast_to_the_forward_dtype():
    emb = Embedding(11, 8, init_std=1.0)
    ids = torch.tensor([[0, 3, 10]])
    rows = emb(ids, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, emb.weight.bfloat16()[ids])
    rows.float().sum().backward()
    assert emb.weight.grad.dtype == torch.float32


def test_sparse_embedding_records_rows_only_in_training():
    emb = SparseEmbedding(5, 3)
    assert list(emb.parameters()) == [] and "weight" in emb.state_dict() and not emb.weight.any()
    ids = torch.tensor([1, 3, 1])
    emb.train()
    (emb(ids) * torch.arange(3.0)[:, None]).sum().backward()
    emb(torch.tensor([4])).sum().backward()
    got_ids, grads = emb.sparse_grad()
    assert got_ids.tolist() == [1, 3, 1, 4]
    assert grads[:, 0].tolist() == [0.0, 1.0, 2.0, 1.0]
    emb.clear_grad()
    assert emb.sparse_grad() is None
    emb.eval()
    emb(ids)
    with torch.no_grad():
        emb.train()(ids)
    assert emb.sparse_grad() is None and not emb._pending


def test_sparse_embedding_refuses_to_leak():
    emb = SparseEmbedding(2, 2).train()
    emb.max_pending = 3
    for _ in range(3):
        emb(torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"SignSGD\.step"):
        emb(torch.tensor([0]))


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


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_mixing_columns_in_blocks_equals_the_whole_matrix_formula_within_fp32_rounding(block):
    torch.manual_seed(0)
    mlp = SwiGLU(97, 4.0)
    cols = torch.randn(97, 300)
    with torch.no_grad():
        whole = add_rms_norm(cols, mlp.forward_columns(cols), 1e-5, dim=0)
        # The BLAS may sum a narrow block's products in another order (blocks of 1 and 7 do, here).
        torch.testing.assert_close(mix_columns_in_blocks(mlp, cols, 1e-5, block), whole)
