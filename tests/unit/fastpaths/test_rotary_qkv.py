"""The attention's projection with RoPE in its epilogue (raytrm.fastpaths.hopper.rotary_qkv): the attention's kernels
over a rotated projection and the operator's gradients (Triton's interpreter), its launch (a stand-in library), its
bits and accuracy on a Hopper GPU."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from raytrm.fastpaths import cublaslt
from raytrm.fastpaths import triton as kernels
from raytrm.fastpaths.hopper import gated, library, rotary_qkv
from raytrm.models.layers import Attention, RotaryEmbedding
from tests.unit.fastpaths.interpreter import count_runs, interpretable, replace_backend, run_interpreted
from tests.unit.fastpaths.test_gated import needs_hopper, stand_in_library
from tests.unit.fastpaths.test_triton import plain_rope_attention


def test_it_serves_no_cpu_tensor():
    x, w = torch.zeros(2, 97, 512, dtype=torch.bfloat16), torch.zeros(1536, 512, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(64, 97, 10000.0)()
    assert rotary_qkv.attention_why_not(x, w, cos, sin, 8, causal=False)


def test_a_launch_hands_the_library_the_pointers_shapes_positions_and_table_stride(monkeypatch):
    # The C signature: five pointers, rows, columns, 512, positions, the tables' row stride, multiprocessors, stream.
    calls = stand_in_library(monkeypatch, raytrm_rotary_qkv=0)
    x, w = torch.zeros(3, 97, 512, dtype=torch.bfloat16), torch.zeros(1536, 512, dtype=torch.bfloat16)
    cos, sin = RotaryEmbedding(64, 128, 10000.0)()
    qkv = rotary_qkv._launch(x, w, cos, sin)
    assert qkv.shape == (3, 97, 1536)
    pointers = (x.data_ptr(), w.data_ptr(), qkv.data_ptr(), cos.data_ptr(), sin.data_ptr())
    assert calls["raytrm_rotary_qkv"] == (*pointers, 3 * 97, 1536, 512, 97, 64, 132, 7)


ROTATED_SCRIPT = """
import torch
from raytrm.fastpaths import cublaslt
from raytrm.fastpaths import triton as kernels
from raytrm.fastpaths.hopper import gated, rotary_qkv
from raytrm.models.layers import RotaryEmbedding
from tests.unit.fastpaths.test_rotary_qkv import rotated

assert kernels.load()
torch.manual_seed(0)

# The attention's kernels over q and k rotated already, as they rotate them (in the interpreter each product and the
# difference rounded to fp32, as torch's CPU formula below does): the rotating kernels' bits, forward and backward.
for batch, positions, heads, head_dim in ((2, 97, 2, 64), (3, 5, 3, 32)):
    qkv = (2 * torch.randn(batch, positions, 3 * heads * head_dim)).bfloat16()
    grad = torch.randn(batch, positions, heads * head_dim).bfloat16()
    cos, sin = RotaryEmbedding(head_dim, positions + 3, 10000.0)()
    out, lse = torch.ops.raytrm.rope_attention(qkv, cos, sin, heads)
    pre = rotated(qkv, cos, sin, heads)
    out_r, lse_r = torch.ops.raytrm.rope_attention(pre, cos, sin, heads, True)
    assert torch.equal(out_r, out) and torch.equal(lse_r[:, :positions], lse[:, :positions])
    backward = torch.ops.raytrm.rope_attention_backward
    expected = backward(qkv, cos, sin, out, lse, grad, heads)
    assert torch.equal(backward(pre, cos, sin, out, lse, grad, heads, True), expected)
    try:
        kernels.rope_attention(pre.requires_grad_(), cos, sin, heads, rotated=True).sum().backward()
        raise AssertionError("a rotated projection's attention has no gradient of its own")
    except RuntimeError as error:
        assert "rotary_qkv.attention" in str(error)

# The operator's gradients, its kernel stood in by the product and that rotation: a Linear's products, so x's and
# w's gradients are the plain path's (the projection, then the rotating attention operator) bit for bit.
heads, head_dim = 2, 64
def stand_in(x, w_ordered, cos, sin):
    w = gated.kernel_order(w_ordered)
    return rotated(cublaslt.linear(x, w), cos, sin, heads)
rotary_qkv._launch = stand_in
x = torch.randn(2, 97, heads * head_dim).bfloat16()
w = (torch.randn(3 * heads * head_dim, heads * head_dim) / 11).bfloat16()
g = torch.randn(2, 97, heads * head_dim).bfloat16()
cos, sin = RotaryEmbedding(head_dim, 100, 10000.0)()
results = []
for path in ("plain", "rotary"):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    if path == "plain":
        out = kernels.rope_attention(cublaslt.linear(xs, ws), cos, sin, heads)
    else:
        out = rotary_qkv.attention(xs, ws, cos, sin, heads)
    out.backward(g)
    results.append((out, xs.grad, ws.grad))
for a, b in zip(*results):
    assert torch.equal(a, b)
with torch.no_grad():
    assert torch.equal(rotary_qkv.attention(x, w, cos, sin, heads), results[0][0])
print("OK")
"""


def rotated(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [B, L, 3 * heads * head_dim] with q's and k's halves rotated by position, (x1 c - x2 s, x2 c + x1 s) in
    fp32, each product and sum rounded to fp32, then to qkv's dtype."""
    L = qkv.shape[1]
    split = qkv.float().unflatten(-1, (3 * heads, -1))
    half = split.shape[-1] // 2
    c, s = cos[:L, None, :half], sin[:L, None, :half]
    x1, x2 = split[..., : 2 * heads, :half], split[..., : 2 * heads, half:]
    qk = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((qk, split[..., 2 * heads :, :]), dim=-2).flatten(-2).to(qkv.dtype)


@interpretable
@pytest.mark.slow  # Triton's CPU interpreter takes seconds a kernel: in the full suite, not the loop
def test_the_attention_over_a_rotated_projection_and_the_operators_gradients_in_tritons_interpreter():
    run_interpreted(ROTATED_SCRIPT)


def test_an_attention_takes_the_rotary_projection_where_it_serves(monkeypatch):
    calls = []
    why_not = lambda x, w, cos, sin, heads, causal: "causal" if causal else None  # noqa: E731
    run = lambda x, w, cos, sin, heads, causal: calls.append(heads) or x  # noqa: E731
    replace_backend("attention", "hopper", monkeypatch, why_not=why_not, run=run)
    cos, sin = RotaryEmbedding(32, 9, 10000.0)()
    x = torch.randn(2, 9, 64)
    for causal, expected in ((False, [2]), (True, [])):
        calls.clear()
        Attention(64, 2, causal=causal)(x, (cos, sin))
        assert calls == expected


def _inputs(batch: int, positions: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, positions, 512, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(1536, 512, device="cuda", generator=gen) / 512**0.5).bfloat16()
    cos, sin = RotaryEmbedding(64, 128, 10000.0).cuda()()
    return x, w, cos, sin


@needs_hopper
@pytest.mark.parametrize("batch, positions", [(768, 97), (3, 97), (2, 5)])
def test_on_hopper_the_projection_has_the_bits_of_cublas_product_then_raytrms_rope(batch, positions):
    kernels.load()
    assert library.load(), library.why_not_built
    x, w, cos, sin = _inputs(batch, positions, batch)
    assert rotary_qkv.attention_why_not(x, w, cos, sin, 8, causal=False) is None
    qkv = torch.ops.raytrm.rotary_qkv(x, gated.kernel_order(w), cos, sin)
    plain = x @ w.t()
    q, k, v = kernels.rope_qkv(plain, cos, sin, 8)
    assert torch.equal(qkv[..., :512], q.flatten(-2)) and torch.equal(qkv[..., 512:1024], k.flatten(-2))
    assert torch.equal(qkv[..., 1024:], v.flatten(-2))


@needs_hopper
def test_on_hopper_the_operator_matches_the_rotating_attention_within_a_rounding_and_counts_its_flops():
    """Against the projection and the attention that rotates q and k itself: the same output and gradients but
    where a rotation's multiply-adds contract otherwise (Triton's choice in each kernel; about 1 in 100,000 of q's
    and k's values a bf16 step apart), as close to the fp64 truth on average, and the same FLOPs."""
    kernels.load()
    assert library.load(), library.why_not_built
    x, w, cos, sin = _inputs(48, 97, 0)
    g = torch.randn(48, 97, 512, device="cuda").bfloat16()
    results, flops = [], []
    for path, dtype in (("plain", torch.float64), ("kernel", torch.bfloat16), ("rotary", torch.bfloat16)):
        xs, ws = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
        with FlopCounterMode(display=False) as counter:
            if path == "plain":
                out = plain_rope_attention(xs @ ws.t(), cos, sin, 8)
            elif path == "kernel":
                out = kernels.rope_attention(cublaslt.linear(xs, ws), cos, sin, 8)
            else:
                out = rotary_qkv.attention(xs, ws, cos, sin, 8)
            out.backward(g.to(dtype))
        results.append((out.detach().double(), xs.grad.double(), ws.grad.double()))
        flops.append(counter.get_total_flops())
    truth, theirs, ours = results
    for a, b, exact in zip(ours, theirs, truth, strict=True):
        assert (a - b).norm() / b.norm() < 1e-3
        assert (a - exact).abs().mean() <= 1.02 * (b - exact).abs().mean()
    assert flops[2] == flops[1]  # the projection's three products and the attention's seven


@needs_hopper
def test_on_hopper_an_attention_takes_the_rotary_projection_and_its_no_grad_form_is_the_same(monkeypatch):
    kernels.load()
    x, _, cos, sin = _inputs(4, 97, 1)
    attention = Attention(512, 8).cuda()
    calls = count_runs("attention", "hopper", monkeypatch)
    with torch.no_grad():
        fast = attention(x, (cos, sin))
    with_grad = attention(x, (cos, sin))  # through the operator's autograd: the weights take gradients
    assert calls == [1, 1] and torch.equal(fast, with_grad.detach())
    monkeypatch.setattr(rotary_qkv, "ENABLED", False)
    with torch.no_grad():
        plain = attention(x, (cos, sin))
    assert calls == [1, 1]
    assert ((plain.float() - fast.float()).norm() / plain.float().norm()) < 4e-3
