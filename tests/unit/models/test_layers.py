"""Shared layers: inits, widths, linear, RoPE tables, attention, the SwiGLU and the embeddings."""

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
    _SmallTableLookup,
    swiglu_width,
    trunc_normal_,
)
from raytrm.models.ops import apply_rotary


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
