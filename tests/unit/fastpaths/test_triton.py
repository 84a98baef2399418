"""The Triton kernels (raytrm.fastpaths.triton): TRM-MLP's fused mixing, the SwiGLU gate and down projection, RoPE and
the attention, equal to the plain formulas within rounding, and the conditions under which each serves.

Without a GPU the kernels run in Triton's CPU interpreter, in a subprocess (Triton reads TRITON_INTERPRET when a
kernel is defined); on a GPU the CUDA tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from raytrm.fastpaths import device
from raytrm.fastpaths import triton as kernels
from raytrm.models.layers import RotaryEmbedding, SwiGLU
from raytrm.models.ops import add_rms_norm, apply_rotary, cast
from tests.unit.fastpaths.interpreter import interpretable, needs_cuda, needs_triton, run_interpreted


def mix_serves(x: torch.Tensor) -> bool:
    return kernels.mix_why_not(x, None, None, 1e-5) is None


def gate_serves(gate_up: torch.Tensor, dim: int) -> bool:
    return kernels.gate_why_not(gate_up, dim) is None


def down_serves(gate_up: torch.Tensor, w_down_shape: tuple[int, int]) -> bool:
    return kernels.down_why_not(gate_up, torch.empty(w_down_shape, device="meta")) is None


def add_norm_serves(x: torch.Tensor, w_down_shape: tuple[int, int], then: torch.Tensor | None = None) -> bool:
    """swiglu_add_norm's conditions for x and a SwiGLU of x's width whose down projection has weight w_down_shape."""
    out, inner = w_down_shape
    w_gate_up = torch.empty(2 * inner, x.shape[-1], device="meta")
    return kernels.add_norm_why_not(x, w_gate_up, torch.empty(out, inner, device="meta"), 1e-5, then) is None


def rope_serves(qkv: torch.Tensor, head_dim: int) -> bool:
    heads = qkv.shape[-1] // (3 * head_dim)
    assert 3 * heads * head_dim == qkv.shape[-1]
    return kernels.rope_why_not(qkv, None, None, heads) is None


def attention_serves(qkv: torch.Tensor, head_dim: int, causal: bool) -> bool:
    return kernels.attention_kernels_why_not(qkv, head_dim, causal) is None


def exact_mix(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain formulas with exact products (fp64), rounded to x's dtype wherever the bf16 forward rounds."""
    dtype = x.dtype

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).double()

    gate, up = rounded(w_gate_up.double() @ x.double()).chunk(2, 0)
    h = rounded(rounded(gate * torch.sigmoid(gate)) * up)
    s = rounded(x.double() + rounded(w_down.double() @ h)).float()
    return (s * torch.rsqrt(s.square().mean(0, keepdim=True) + eps)).to(dtype)


def assert_within_a_rounding(y: torch.Tensor, exact: torch.Tensor) -> None:
    """Nearly all of y equals exact; the rest is off by about a rounding of the sum before the norm (outputs are
    of order 1, so by at most 2^-6, one bf16 step at 2 to 4): fp32 sums in another order, rounded, differ in under
    1% of elements."""
    off = (y.float() - exact.float()).abs()
    assert off.max() <= 2**-6 and (off > 0).float().mean() < 0.01, (off.max(), (off > 0).float().mean())


def test_without_triton_or_off_cuda_the_plain_formulas_serve(monkeypatch):
    x = torch.zeros(97, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    with torch.no_grad():
        assert not mix_serves(x)  # a CPU tensor, no interpreter
    monkeypatch.setattr(kernels, "_loaded", False)
    with torch.no_grad():
        assert not mix_serves(x.to("meta"))


def test_the_kernel_serves_only_forwards_without_a_graph(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "INTERPRETED", True)
    x = torch.zeros(97, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert mix_serves(x)
        assert not mix_serves(x.float())  # fp32 states take the plain formulas
        assert not mix_serves(torch.zeros(kernels.MAX_POSITIONS + 1, 8, dtype=torch.bfloat16))
    assert not mix_serves(x)  # grad mode: the back-propagated round


def test_the_gate_operator_serves_contiguous_half_precision_split_along_the_first_or_last_dimension(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "INTERPRETED", True)
    x = torch.zeros(6, 4, 8, dtype=torch.bfloat16)
    assert gate_serves(x, 0) and gate_serves(x, -1)
    assert gate_serves(x, 2)
    assert not gate_serves(x, 1)  # a middle dimension takes the plain formula
    assert not gate_serves(x.transpose(0, 2), 0)  # so does a strided view
    assert not gate_serves(x.float(), -1)
    assert not gate_serves(torch.zeros(6, 7, dtype=torch.bfloat16), -1)  # no halves
    with torch.no_grad():
        assert gate_serves(x, -1)  # with or without a graph, unlike the mixing kernel
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    assert not gate_serves(x, -1)  # on a CPU without the interpreter


GATE_SCRIPT = """
import torch
from raytrm.fastpaths import triton as kernels
from raytrm.models.ops import _SwiGLUGate, swiglu_gate
from tests.unit.fastpaths.test_triton import gate_serves

assert kernels.load()
torch.manual_seed(0)
# TRM-MLP's mixing (split along the first dimension of [2 * inner, columns]), the feature SwiGLU's (along the
# last), and widths that are no multiple of a block.
for shape, dim in (((2 * 64, 300), 0), ((2 * 3, 4, 5), 0), ((5, 7, 2 * 96), -1), ((3, 2 * 1500), -1)):
    x = (3 * torch.randn(shape)).bfloat16()
    assert gate_serves(x, dim)  # so swiglu_gate runs the operator
    ours, plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = swiglu_gate(ours, dim)
    expected = _SwiGLUGate.apply(plain, dim)  # the CPU's bf16 formulas, rounding where the operator rounds
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    assert out.shape == expected.shape and ours.grad.shape == x.shape
    for a, b in ((out, expected), (ours.grad, plain.grad)):
        off = (a.float() - b.float()).abs()
        # Equal but for the odd element a bf16 step apart (fp32 sigmoid against the CPU's silu, then rounded).
        assert (off > 0).float().mean() < 1e-3 and (off <= b.float().abs() * 2**-7).all(), (shape, off.max())
print("OK")
"""


@interpretable
@pytest.mark.slow  # Triton's CPU interpreter takes seconds a kernel: in the full suite, not the loop
def test_the_gate_operator_equals_the_plain_formulas_forward_and_backward_in_tritons_interpreter():
    run_interpreted(GATE_SCRIPT)


def test_the_swiglu_down_operator_serves_contiguous_half_precision_with_widths_in_multiples_of_64(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "INTERPRETED", True)
    monkeypatch.setattr(kernels, "_descriptors", True)
    gate_up = torch.zeros(6, 4, 2 * 128, dtype=torch.bfloat16)
    assert down_serves(gate_up, (64, 128))
    with torch.no_grad():
        assert down_serves(gate_up, (64, 128))  # with or without a graph
    monkeypatch.setattr(kernels, "_descriptors", False)  # a Triton without tensor descriptors: no backward kernel
    assert not down_serves(gate_up, (64, 128))
    with torch.no_grad():
        assert down_serves(gate_up, (64, 128))
    monkeypatch.setattr(kernels, "_descriptors", True)
    assert not down_serves(gate_up, (64, 96))  # gate_up is not [gate | up] of this inner
    assert not down_serves(torch.zeros(6, 2 * 96, dtype=torch.bfloat16), (64, 96))
    assert not down_serves(gate_up, (48, 128))  # out no multiple of 64
    assert not down_serves(gate_up.transpose(0, 1), (64, 128))
    assert not down_serves(gate_up.float(), (64, 128))
    # With the residual add and norm: only without a graph, a tile holding whole rows of a power of two.
    x = torch.zeros(6, 4, 64, dtype=torch.bfloat16)
    assert not add_norm_serves(x, (64, 128))  # grad mode: the back-propagated round
    with torch.no_grad():
        assert add_norm_serves(x, (64, 128))
        assert not add_norm_serves(torch.zeros(6, 4, 192, dtype=torch.bfloat16), (192, 128))
        wide = kernels.MAX_NORM_WIDTH * 2
        assert not add_norm_serves(torch.zeros(6, 4, wide, dtype=torch.bfloat16), (wide, 128))
        assert not add_norm_serves(x.float(), (64, 128))
        assert not add_norm_serves(x, (64, 128), then=x[:3])  # rows unlike the residual's
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    assert not down_serves(gate_up, (64, 128))  # on a CPU without the interpreter


SWIGLU_DOWN_SCRIPT = """
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from raytrm.fastpaths import triton as kernels
from raytrm.models.layers import SwiGLU
from raytrm.models.ops import _SwiGLUGate, add_rms_norm
from tests.unit.fastpaths.test_triton import add_norm_serves, down_serves

assert kernels.load()
torch.manual_seed(0)
# Rows and widths that are no multiple of a tile, and a batch of rows in three dimensions.
for shape, out, inner in (((37,), 64, 128), ((5,), 128, 192), ((2, 65), 64, 64)):
    gate_up = (2 * torch.randn(*shape, 2 * inner)).bfloat16()
    w = (torch.randn(out, inner) * inner**-0.5).bfloat16()
    assert down_serves(gate_up, w.shape)
    ours, plain = gate_up.clone().requires_grad_(), gate_up.clone().requires_grad_()
    w_ours, w_plain = w.clone().requires_grad_(), w.clone().requires_grad_()
    with FlopCounterMode(display=False) as counted_ours:
        y = kernels.swiglu_down(ours, w_ours)
        grad = torch.randn_like(y)
        y.backward(grad)
    with FlopCounterMode(display=False) as counted_plain:
        expected = F.linear(_SwiGLUGate.apply(plain, -1), w_plain)  # the CPU's bf16 formulas
        expected.backward(grad)
    x = torch.randn(*shape, out).bfloat16()  # a residual stream
    with torch.no_grad():
        y_no_grad = kernels.swiglu_down(gate_up, w)  # the gate inside the product
        assert add_norm_serves(x, w.shape)
        normed = kernels.swiglu_down_norm(gate_up, w, x, 1e-5)  # and the residual add and norm after it
        then = torch.randn_like(x)  # and the next recursion's injection after those, to the bit
        assert add_norm_serves(x, w.shape, then)
        assert not add_norm_serves(x, w.shape, then.float())
        assert torch.equal(kernels.swiglu_down_norm(gate_up, w, x, 1e-5, then), normed + then)
        kernels._descriptors = False  # as on a GPU without TMA copies: the pointer-load kernel, to the same bits
        assert torch.equal(kernels.swiglu_down_norm(gate_up, w, x, 1e-5), normed)
        assert torch.equal(kernels.swiglu_down_norm(gate_up, w, x, 1e-5, then), normed + then)
        kernels._descriptors = True
    expected_normed = add_rms_norm(x, expected.detach(), 1e-5)  # the eager formulas: the add rounded, the norm fp32
    assert counted_ours.get_total_flops() == counted_plain.get_total_flops() > 0
    pairs = ((y, expected), (y_no_grad, expected), (ours.grad, plain.grad), (w_ours.grad, w_plain.grad))
    for a, b in pairs + ((normed, expected_normed),):
        assert a.shape == b.shape and a.dtype == b.dtype
        off = (a.float() - b.float()).abs()
        # Equal but for the odd element a bf16 step apart (fp32 sums in another order, then rounded).
        assert (off > 0).float().mean() < 0.02 and (off <= b.float().abs() * 2**-7 + 1e-30).all(), (shape, off.max())
    # SwiGLU's forward takes the operator where it serves.
    mlp = SwiGLU(out, 2.0)
    x = torch.randn(3, out).bfloat16()
    with FlopCounterMode(display=False) as counted:
        y = mlp(x)
    assert torch.ops.raytrm.swiglu_down_keeping_gate in counted.get_flop_counts()["Global"]
    assert torch.equal(y, F.linear(_SwiGLUGate.apply(mlp.gate_up_proj(x), -1), mlp.down_proj.weight.bfloat16()))
    with torch.no_grad(), FlopCounterMode(display=False) as counted:
        y = mlp.add_norm(x, 1e-5)
    assert torch.ops.raytrm.swiglu_down_norm in counted.get_flop_counts()["Global"]
    with torch.no_grad():
        down = F.linear(_SwiGLUGate.apply(mlp.gate_up_proj(x), -1), mlp.down_proj.weight.bfloat16())
        expected = add_rms_norm(x, down, 1e-5)
    off = (y.float() - expected.float()).abs()
    assert (off > 0).float().mean() < 0.02 and (off <= expected.float().abs() * 2**-7 + 1e-30).all(), off.max()

# Inside an opaque operator the kernels are launched directly: wrap_triton's dispatch there costs the host about
# 1 ms a call.
def refused(kernel):
    raise AssertionError("wrap_triton inside an opaque operator")

torch.library.wrap_triton, wrap = refused, torch.library.wrap_triton
gate_up = (2 * torch.randn(5, 128)).bfloat16().requires_grad_()
kernels.swiglu_down(gate_up, (torch.randn(64, 64) * 0.125).bfloat16()).sum().backward()
torch.library.wrap_triton = wrap
print("OK")
"""


@interpretable
@pytest.mark.slow  # Triton's CPU interpreter takes seconds a kernel: in the full suite, not the loop
def test_the_swiglu_down_operator_equals_the_plain_formulas_forward_and_backward_in_tritons_interpreter():
    run_interpreted(SWIGLU_DOWN_SCRIPT)


def test_the_rope_operator_serves_contiguous_projections_but_compiled_no_grad_rounds(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "INTERPRETED", True)
    qkv = torch.zeros(2, 97, 3 * 8 * 64, dtype=torch.bfloat16)
    assert rope_serves(qkv, 64)
    with torch.no_grad():
        assert rope_serves(qkv, 64)  # eager no-grad rounds: one pass against _Rotary's several
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not rope_serves(qkv, 64)  # inductor's own fused rotation leaves v in place
    assert rope_serves(qkv, 64)  # compiled, with a graph: the operator's one-pass backward
    assert not rope_serves(torch.zeros(2, 97, 3 * 8 * 48, dtype=torch.bfloat16), 48)  # half a head no power of two
    assert not rope_serves(qkv[:, :, : 3 * 8 * 32], 32)  # a strided view
    assert not rope_serves(qkv.float(), 64)
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    assert not rope_serves(qkv, 64)  # on a CPU without the interpreter


ROPE_SCRIPT = """
import torch
from raytrm.fastpaths import triton as kernels
from raytrm.models.layers import Attention, RotaryEmbedding
from raytrm.models.ops import _Rotary
from tests.unit.fastpaths.interpreter import count_runs
from tests.unit.fastpaths.test_triton import rope_serves

assert kernels.load()
torch.manual_seed(0)


def within_a_step(a, b):
    off = (a.float() - b.float()).abs()
    # Equal but for the odd element a bf16 step apart (numpy's products against torch's multiply-adds, rounded).
    assert a.shape == b.shape and (off > 0).float().mean() < 1e-3 and (off <= b.float().abs() * 2**-7).all(), off.max()


# TRM's Sudoku heads, and a head count and token count that are no multiple of a block.
for batch, positions, heads, head_dim in ((2, 97, 8, 64), (3, 5, 3, 16)):
    qkv = (3 * torch.randn(batch, positions, 3 * heads * head_dim)).bfloat16()
    assert rope_serves(qkv, head_dim)
    cos, sin = RotaryEmbedding(head_dim, positions + 3, 10000.0)()
    ours, plain = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    q, k, v = kernels.rope_qkv(ours, cos, sin, heads)
    split = plain.unflatten(-1, (3 * heads, head_dim))
    half = head_dim // 2
    qk = _Rotary.apply(split[..., : 2 * heads, :], cos[:positions, None, :half], sin[:positions, None, :half])
    expected = (*qk.split(heads, dim=-2), split[..., 2 * heads :, :])
    grads = [torch.randn_like(t) for t in expected]
    # Gradients in SDPA's strides ([batch, heads, positions, head_dim] transposed back), as the attention's are.
    torch.autograd.backward((q, k, v), [g.transpose(1, 2).contiguous().transpose(1, 2) for g in grads])
    torch.autograd.backward(expected, grads)
    for a, b in zip((q, k, ours.grad), (*expected[:2], plain.grad)):
        within_a_step(a, b)
    assert torch.equal(v, expected[2])  # copied
    assert torch.equal(ours.grad[..., 2 * heads * head_dim :], plain.grad[..., 2 * heads * head_dim :])

# In the attention: the operator serves, and its output is the plain formulas' within a rounding.
attention = Attention(64, 4).bfloat16()
cos, sin = RotaryEmbedding(16, 97, 10000.0)()
x = torch.randn(2, 97, 64).bfloat16()
calls = count_runs("rope_qkv", "triton")
with torch.no_grad():
    fused = attention(x, (cos, sin))
    kernels._loaded = False
    plain = attention(x, (cos, sin))
assert calls == [1], calls
off = (fused.float() - plain.float()).abs()
assert off.max() <= 2**-6 * plain.float().abs().max(), off.max()
print("OK")
"""


@interpretable
@pytest.mark.slow  # Triton's CPU interpreter takes seconds a kernel: in the full suite, not the loop
def test_the_rope_operator_equals_the_plain_rotation_forward_and_backward_in_tritons_interpreter():
    run_interpreted(ROPE_SCRIPT)


def test_the_attention_operator_serves_whole_sequences_of_at_most_128_positions_eager_or_compiled(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "INTERPRETED", True)
    qkv = torch.zeros(2, 97, 3 * 8 * 64, dtype=torch.bfloat16)
    monkeypatch.setattr(kernels, "_descriptors", False)
    assert not attention_serves(qkv, 64, causal=False)  # a Triton without tensor descriptors
    monkeypatch.setattr(kernels, "_descriptors", True)
    assert attention_serves(qkv, 64, causal=False)
    with torch.no_grad():
        assert attention_serves(qkv, 64, causal=False)  # eager no-grad rounds
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        # Compiled no-grad rounds too, where the RoPE operator gives way to inductor's rotation: the attention's
        # forward is faster than that rotation and cuDNN's forward.
        assert attention_serves(qkv, 64, causal=False)
        assert not rope_serves(qkv, 64)
    assert attention_serves(qkv, 64, causal=False)  # compiled, with a graph: the one backward
    assert not attention_serves(qkv[..., : 3 * 8 * 32], 32, causal=False)  # a strided view
    assert attention_serves(torch.zeros(2, 97, 3 * 8 * 32, dtype=torch.bfloat16), 32, causal=False)
    assert not attention_serves(qkv, 64, causal=True)  # the language model's
    assert not attention_serves(torch.zeros(1, 129, 3 * 64, dtype=torch.bfloat16), 64, causal=False)
    assert not attention_serves(torch.zeros(1, 9, 3 * 4 * 16, dtype=torch.bfloat16), 16, causal=False)
    assert not attention_serves(torch.zeros(1, 9, 3 * 4 * 48, dtype=torch.bfloat16), 48, causal=False)
    assert not attention_serves(qkv.float(), 64, causal=False)
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    assert not attention_serves(qkv, 64, causal=False)  # on a CPU without the interpreter


def test_before_hopper_the_kernels_with_tma_copies_give_way_to_the_plain_formulas(monkeypatch):
    # Fake CUDA tensors: only their device, dtype, shape and strides are read.
    with FakeTensorMode():
        qkv = torch.empty(2, 97, 3 * 8 * 64, dtype=torch.bfloat16, device="cuda")
        gate_up = torch.empty(6, 4, 2 * 128, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "_descriptors", True)
    asked = []
    for capability, served in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(device, "capability", lambda d, c=capability: asked.append(d) or c)
        assert attention_serves(qkv, 64, causal=False) is served
        assert down_serves(gate_up, (64, 128)) is served  # its backward kernel's copies
        with torch.no_grad():  # the no-grad rounds' kernel loads through pointers, on any GPU
            assert down_serves(gate_up, (64, 128))
    assert set(asked) == {torch.device("cuda", 0)}


def test_torch_compile_reads_the_gpus_capability_as_a_constant_without_a_graph_break(monkeypatch):
    capability = {"cpu": (9, 0)}

    def read(device: torch.device) -> tuple[int, int]:
        torch._dynamo.graph_break()  # as torch.cuda's query might: traced, this would break the graph
        return capability[device.type]

    monkeypatch.setattr(device, "capability", read)
    torch._dynamo.reset()

    @torch.compile(backend="eager", fullgraph=True)  # a graph break raises
    def branch(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if device.tma_device(x.device) else x - 1

    assert branch(torch.zeros(2)).tolist() == [1.0, 1.0]
    torch._dynamo.reset()
    capability["cpu"] = (8, 0)
    assert branch(torch.zeros(2)).tolist() == [-1.0, -1.0]


ATTENTION_SCRIPT = """
import torch
from torch.utils.flop_counter import FlopCounterMode
from raytrm.fastpaths import triton as kernels
from raytrm.models.layers import Attention, RotaryEmbedding
from tests.unit.fastpaths.interpreter import count_runs
from tests.unit.fastpaths.test_triton import assert_as_close_to_exact, attention_results

assert kernels.load()
torch.manual_seed(0)

# Sudoku's 97 positions (no multiple of a block), and a head of 32 over a handful: 9 heads, so each of the
# interpreter's 2 programs takes several in turn.
for batch, positions, heads, head_dim in ((1, 97, 2, 64), (3, 5, 3, 32)):
    qkv = 2 * torch.randn(batch, positions, 3 * heads * head_dim, dtype=torch.float64)
    grad = torch.randn(batch, positions, heads * head_dim, dtype=torch.float64)
    cos, sin = RotaryEmbedding(head_dim, positions + 3, 10000.0)()
    assert_as_close_to_exact(attention_results(qkv, grad, cos, sin, heads))
    # Counted as torch counts SDPA: two products forward, five backward.
    x = qkv.bfloat16().requires_grad_()
    with FlopCounterMode(display=False) as counter:
        kernels.rope_attention(x, cos, sin, heads).backward(grad.bfloat16())
    assert counter.get_total_flops() == 7 * 2 * batch * positions**2 * heads * head_dim

# Tensors that do not start on 16 bytes (views at an offset), which a tensor descriptor cannot take, are copied:
# the same results.
def shifted(t):
    view = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view_as(t).copy_(t)
    assert view.data_ptr() % 16 and view.is_contiguous()
    return view

qkv, grad = torch.randn(2, 9, 3 * 2 * 32).bfloat16(), torch.randn(2, 9, 2 * 32).bfloat16()
cos, sin = RotaryEmbedding(32, 9, 10000.0)()
out, lse = torch.ops.raytrm.rope_attention(qkv, cos, sin, 2)
out_shifted, lse_shifted = torch.ops.raytrm.rope_attention(shifted(qkv), cos, sin, 2)
assert torch.equal(out_shifted, out) and torch.equal(lse_shifted[:, :9], lse[:, :9])
backward = torch.ops.raytrm.rope_attention_backward
expected = backward(qkv, cos, sin, out, lse, grad, 2)
assert torch.equal(backward(shifted(qkv), cos, sin, shifted(out), lse, shifted(grad), 2), expected)

# In the attention: the operator serves whole sequences with RoPE, and not the causal one.
cos, sin = RotaryEmbedding(32, 97, 10000.0)()
x = torch.randn(2, 97, 64).bfloat16()
calls = count_runs("rope_attention", "triton")
for causal, expected in ((False, [1]), (True, [])):
    calls.clear()
    attention = Attention(64, 2, causal=causal).bfloat16()
    with torch.no_grad():
        attention(x, (cos, sin))
    assert calls == expected, (causal, calls)
print("OK")
"""


@interpretable
@pytest.mark.slow  # Triton's CPU interpreter takes seconds a kernel: in the full suite, not the loop
def test_the_attention_operator_is_as_close_to_exact_as_the_plain_path_in_tritons_interpreter():
    run_interpreted(ATTENTION_SCRIPT)


def plain_rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """RoPE then SDPA over qkv [B, L, 3 * heads * head_dim] with the plain formulas, as Attention does without the
    kernels: [B, L, heads * head_dim]."""
    L, head_dim = qkv.shape[1], qkv.shape[-1] // (3 * heads)
    split = qkv.unflatten(-1, (3 * heads, head_dim))
    q, k = apply_rotary(split[..., : 2 * heads, :], cos[:L, None], sin[:L, None]).split(heads, dim=-2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, split[..., 2 * heads :, :]))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)


def attention_results(
    qkv: torch.Tensor, grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, qkv's gradient), in fp64, of the plain path in fp64 (the truth), the plain path in bf16 and the
    attention operator in bf16, from qkv and the output's gradient grad."""
    results = []
    for f, dtype in (
        (plain_rope_attention, torch.float64),
        (plain_rope_attention, torch.bfloat16),
        (kernels.rope_attention, torch.bfloat16),
    ):
        x = qkv.detach().to(dtype).requires_grad_()
        out = f(x, cos, sin, heads)
        out.backward(grad.to(dtype))
        results.append((out.detach().double(), x.grad.double()))
    return results


def assert_as_close_to_exact(results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The operator (bf16 products, fp32 sums, rounded as flash attention's kernels round) is as close to the truth
    as the plain bf16 path, output and gradient, at its largest and on average (attention_results' results)."""
    exact, plain, ours = results
    for a, b, truth in zip(ours, plain, exact, strict=True):
        a, b = (a - truth).abs(), (b - truth).abs()
        assert a.max() <= 1.05 * b.max() and a.mean() <= 1.05 * b.mean(), (a.max(), b.max(), a.mean(), b.mean())


INTERPRETER_SCRIPT = """
import torch
from torch.utils.flop_counter import FlopCounterMode
from raytrm.config import ModelConfig
from raytrm.fastpaths import triton as kernels
from raytrm.models import TRM
from raytrm.models.layers import SwiGLU
from raytrm.models.ops import cast
from tests.unit.fastpaths.interpreter import count_runs
from tests.unit.fastpaths.test_triton import assert_within_a_rounding, exact_mix

assert kernels.load()
torch.manual_seed(0)
# Sudoku's 97 positions (81 cells and 16 puzzle slots) and a width that is no multiple of a block of columns.
for positions, columns in ((97, 300), (30, 70)):
    mlp = SwiGLU(positions, 4.0)
    x = (3 * torch.randn(positions, columns)).bfloat16()
    w_gate_up, w_down = cast(mlp.gate_up_proj.weight, x.dtype), cast(mlp.down_proj.weight, x.dtype)
    with torch.no_grad():
        y = kernels.mix_positions_norm(x, w_gate_up, w_down, 1e-5)
    assert_within_a_rounding(y, exact_mix(x, w_gate_up, w_down, 1e-5))
    # torch's FLOP counter (the benchmarks') counts the kernel's products as it counts the plain formulas'.
    counts = []
    for mix in (lambda: kernels.mix_positions_norm(x, w_gate_up, w_down, 1e-5), lambda: mlp.forward_columns(x)):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            mix()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0, counts

# In the model: the no-grad rounds take the kernel and end no further from fp32 than the plain bf16 forward.
config = ModelConfig(variant="mlp_t", hidden_size=64, H_cycles=2, L_cycles=2, L_layers=2, num_heads=2)
model = TRM(config, vocab_size=11, seq_len=81, dtype=torch.bfloat16).eval()
exact = TRM(config, vocab_size=11, seq_len=81, dtype=torch.float32).eval()
exact.load_state_dict(model.state_dict())
batch = {
    "inputs": torch.randint(0, 11, (4, 81)),
    "labels": torch.randint(0, 11, (4, 81)),
    "puzzle_identifiers": torch.zeros(4, dtype=torch.long),
}
calls = count_runs("mix_positions_norm", "triton")
with torch.no_grad():
    fused = model(model.initial_carry(batch), batch)[1]["logits"].float()
    assert len(calls) == 2 * 3 * 2, len(calls)  # rounds x (L_cycles + 1) x layers
    kernels._loaded = False
    plain = model(model.initial_carry(batch), batch)[1]["logits"].float()
    reference = exact(exact.initial_carry(batch), batch)[1]["logits"]
fused_error, plain_error = (fused - reference).abs().mean(), (plain - reference).abs().mean()
assert fused_error <= 1.1 * plain_error, (fused_error, plain_error)
print("OK", fused_error.item(), plain_error.item())
"""


@interpretable
@pytest.mark.slow
def test_the_kernel_equals_the_plain_formulas_within_a_rounding_in_tritons_interpreter():
    run_interpreted(INTERPRETER_SCRIPT)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_kernel_equals_the_plain_formulas_within_a_rounding(dtype):
    assert kernels.load()
    torch.manual_seed(0)
    mlp = SwiGLU(97, 4.0).cuda()
    x = (3 * torch.randn(97, 768 * 64, device="cuda")).to(dtype)
    w_gate_up, w_down = cast(mlp.gate_up_proj.weight, dtype), cast(mlp.down_proj.weight, dtype)
    with torch.no_grad():
        y = kernels.mix_positions_norm(x, w_gate_up, w_down, 1e-5)
        plain = add_rms_norm(x, mlp.forward_columns(x), 1e-5, dim=0)
        # Traced into a compiled graph as an operator: on an H200 within a rounding of the eager call, not to the bit.
        compiled = torch.compile(kernels.mix_positions_norm, fullgraph=True)(x, w_gate_up, w_down, 1e-5)
    exact = exact_mix(x, w_gate_up, w_down, 1e-5)
    for out in (y, compiled):
        if dtype == torch.bfloat16:
            assert_within_a_rounding(out, exact)
        assert (out.float() - exact.float()).abs().max() <= (plain.float() - exact.float()).abs().max()


@needs_cuda
@needs_triton
def test_on_cuda_every_tile_the_autotuner_may_pick_gives_the_same_bits():
    import triton

    from raytrm.fastpaths.triton import mix as tk

    torch.manual_seed(0)
    positions, columns = 97, 96 * 256
    mlp = SwiGLU(positions, 4.0).cuda()
    x = (3 * torch.randn(positions, columns, device="cuda")).bfloat16()
    inner = mlp.down_proj.weight.shape[1]
    w_gate_up, w_down = cast(mlp.gate_up_proj.weight, x.dtype), cast(mlp.down_proj.weight, x.dtype)
    w_gate_up_t, w_down_t = tk.padded_weights(w_gate_up, w_down, 128)
    outputs = []
    for config in tk._CONFIGS:
        y = torch.empty_like(x)
        block_n = config.kwargs["BLOCK_N"]
        tk.mix_positions_norm_kernel.fn[(triton.cdiv(columns, block_n),)](
            x,
            w_gate_up_t,
            w_down_t,
            y,
            columns,
            positions,
            inner,
            1e-5,
            BLOCK_L=128,
            BLOCK_N=block_n,
            BLOCK_I=tk.BLOCK_I,
            INTERPRETED=False,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        outputs.append(y)
    assert all(torch.equal(y, outputs[0]) for y in outputs[1:])
    with torch.no_grad():
        assert torch.equal(kernels.mix_positions_norm(x, w_gate_up, w_down, 1e-5), outputs[0])


@needs_cuda
@needs_triton
def test_on_cuda_every_launch_the_attention_autotuners_may_pick_gives_the_same_bits():
    from triton.tools.tensor_descriptor import TensorDescriptor

    from raytrm.fastpaths.triton import attention as tk

    torch.manual_seed(0)
    B, L, H, D = 48, 97, 8, 64
    qkv = torch.randn(B, L, 3 * H * D, device="cuda").bfloat16()
    grad = torch.randn(B, L, H * D, device="cuda").bfloat16()
    cos, sin = RotaryEmbedding(D, 128, 10000.0).cuda()()
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    kernels.load()

    def run(kernel, config, tiles, lse):
        descriptors = [TensorDescriptor.from_tensor(t, [1, 128, D // 2 if half else D]) for t, half in tiles]
        programs = min(B * H, config.kwargs["PROGRAMS_PER_SM"] * multiprocessors)
        kernel.fn[(programs,)](
            *descriptors, cos, sin, lse, B * H, L, H, cos.stride(0), D**-0.5, BLOCK_L=128, HALF=D // 2,
            ROTATED=False, INTERPRETED=False, num_warps=config.num_warps, **config.kwargs,
        )  # fmt: skip

    forwards, backwards = [], []
    for config in tk.rope_attention_kernel.configs:
        out, lse = qkv.new_empty(B, L, H * D), torch.empty(B * H, 128, device="cuda")
        run(tk.rope_attention_kernel, config, [(qkv, True), (qkv, False), (out, False)], lse)
        forwards.append((out, lse))
    out, lse = forwards[0]
    for config in tk.rope_attention_backward_kernel.configs:
        grad_qkv = torch.empty_like(qkv)
        tiles = [(qkv, True), (qkv, False), (out, False), (grad, False), (grad_qkv, True), (grad_qkv, False)]
        run(tk.rope_attention_backward_kernel, config, tiles, lse)
        backwards.append(grad_qkv)
    assert len(tk.rope_attention_kernel.configs) > 1
    assert all(torch.equal(o, out) and torch.equal(s, lse) for o, s in forwards[1:])
    assert all(torch.equal(g, backwards[0]) for g in backwards[1:])
    assert torch.equal(kernels.rope_attention(qkv, cos, sin, H), out)


@needs_cuda
@needs_triton
def test_on_cuda_every_tile_the_down_projections_backward_autotuner_may_pick_gives_the_same_bits():
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from raytrm.fastpaths.triton import down as tk

    torch.manual_seed(0)
    M, N, F = 3000, 512, 1536
    grad = torch.randn(M, N, device="cuda").bfloat16()
    w = (torch.randn(N, F, device="cuda") * F**-0.5).bfloat16()
    gate_up = (2 * torch.randn(M, 2 * F, device="cuda")).bfloat16()
    results = []
    for config in tk.swiglu_down_backward_kernel.configs:
        m, n, k = (config.kwargs[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        grad_gate_up = torch.empty_like(gate_up)
        descriptors = (
            TensorDescriptor.from_tensor(grad, [m, k]),
            TensorDescriptor.from_tensor(w, [k, n]),
            *(TensorDescriptor.from_tensor(t.view(M, 2, F), [m, 1, n]) for t in (gate_up, grad_gate_up)),
        )
        tk.swiglu_down_backward_kernel.fn[(triton.cdiv(M, m) * triton.cdiv(F, n),)](
            *descriptors, M, N, F, GROUP=tk.SWIGLU_DOWN_GROUP, INTERPRETED=False, num_warps=config.num_warps,
            num_stages=config.num_stages, **config.kwargs,
        )  # fmt: skip
        results.append(grad_gate_up)
    assert len(results) > 1
    assert all(torch.equal(r, results[0]) for r in results[1:])
    h = torch.empty(M, F, device="cuda").bfloat16()
    assert torch.equal(torch.ops.raytrm.swiglu_down_backward(grad, gate_up, w, h)[0], results[0])


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dim", [0, -1])
def test_on_cuda_the_gate_operator_equals_the_plain_formulas_eager_and_compiled(dim):
    from raytrm.models.ops import _SwiGLUGate

    assert kernels.load()
    torch.manual_seed(0)
    shape = (2 * 512, 768 * 8) if dim == 0 else (768, 8, 2 * 1536)
    x = (3 * torch.randn(shape, device="cuda")).bfloat16()
    expected = x.clone().requires_grad_()
    plain = _SwiGLUGate.apply(expected, dim)
    grad = torch.randn_like(plain)
    plain.backward(grad)
    for gate in (kernels.swiglu_gate, torch.compile(kernels.swiglu_gate, fullgraph=True)):
        ours = x.clone().requires_grad_()
        out = gate(ours, dim)
        out.backward(grad)
        for a, b in ((out, plain), (ours.grad, expected.grad)):
            off = (a.float() - b.float()).abs()
            # Within a bf16 step where CUDA's fused multiply-adds round otherwise than the eager kernels.
            assert (off <= b.float().abs() * 2**-7 + 1e-30).all() and (off > 0).float().mean() < 0.05, off.max()


@needs_cuda
@needs_triton
def test_on_cuda_the_swiglu_down_operator_equals_the_plain_formulas_eager_and_compiled():
    from raytrm.models.ops import _SwiGLUGate

    assert kernels.load()
    torch.manual_seed(0)
    gate_up = (2 * torch.randn(96, 97, 2 * 1536, device="cuda")).bfloat16()
    w = (torch.randn(512, 1536, device="cuda") * 1536**-0.5).bfloat16()
    plain, w_plain = gate_up.clone().requires_grad_(), w.clone().requires_grad_()
    expected = F.linear(_SwiGLUGate.apply(plain, -1), w_plain)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    for down in (kernels.swiglu_down, torch.compile(kernels.swiglu_down, fullgraph=True)):
        ours, w_ours = gate_up.clone().requires_grad_(), w.clone().requires_grad_()
        y = down(ours, w_ours)
        y.backward(grad)
        with torch.no_grad():
            y_no_grad = down(gate_up, w)
        for a, b in ((y, expected), (y_no_grad, expected), (ours.grad, plain.grad), (w_ours.grad, w_plain.grad)):
            off = (a.float() - b.float()).abs()
            # Within a bf16 step where sums run in another order or fused multiply-adds round otherwise.
            assert (off <= b.float().abs() * 2**-7 + 1e-30).all() and (off > 0).float().mean() < 0.05, off.max()
    # With the residual add and norm in the epilogue (no graph), against the eager formulas.
    x = torch.randn(96, 97, 512, device="cuda").bfloat16()
    with torch.no_grad():
        expected = add_rms_norm(x, expected.detach(), 1e-5)
        then = torch.randn_like(x)
        for down_norm in (kernels.swiglu_down_norm, torch.compile(kernels.swiglu_down_norm, fullgraph=True)):
            y = down_norm(gate_up, w, x, 1e-5)
            off = (y.float() - expected.float()).abs()
            assert (off <= expected.float().abs() * 2**-7 + 1e-30).all() and (off > 0).float().mean() < 0.05, off.max()
            assert torch.equal(down_norm(gate_up, w, x, 1e-5, then), y + then)
        # The kernel with TMA copies (this GPU's, where it has them) gives the pointer-load kernel's bits.
        y = kernels.swiglu_down_norm(gate_up, w, x, 1e-5, then)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "_descriptors", False)
            assert torch.equal(kernels.swiglu_down_norm(gate_up, w, x, 1e-5, then), y)


@needs_cuda
@needs_triton
def test_on_cuda_the_rope_operator_equals_the_plain_rotation_eager_and_compiled():
    assert kernels.load()
    torch.manual_seed(0)
    batch, positions, heads, head_dim = 64, 97, 8, 64
    cos, sin = RotaryEmbedding(head_dim, positions, 10000.0).cuda()()
    qkv = (3 * torch.randn(batch, positions, 3 * heads * head_dim, device="cuda")).bfloat16()
    grad = torch.randn(batch, positions, heads * head_dim, device="cuda").bfloat16()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)

    def plain(qkv: torch.Tensor) -> torch.Tensor:
        return plain_rope_attention(qkv, cos, sin, heads)

    def fused(qkv: torch.Tensor) -> torch.Tensor:
        return attend(*kernels.rope_qkv(qkv, cos, sin, heads))

    results = []
    for f in (plain, fused, torch.compile(plain, fullgraph=True), torch.compile(fused, fullgraph=True)):
        x = qkv.clone().requires_grad_()
        out = f(x)
        out.backward(grad)
        results.append((out, x.grad))
    # The operator equals the compiled formula to the bit (seen on an H200), and both are within a rounding of the
    # eager formula (which rounds the same values, through other kernels).
    for a, b in zip(results[1], results[2], strict=True):
        off = (a.float() - b.float()).abs()
        assert (off <= b.float().abs() * 2**-7 + 1e-30).all() and (off > 0).float().mean() < 0.01, off.max()
    for a, b in zip(results[3], results[2], strict=True):
        assert torch.equal(a, b)


@needs_cuda
@needs_triton
def test_on_cuda_the_attention_operator_is_as_close_to_exact_as_cudnns_eager_and_compiled():
    assert kernels.load()
    torch.manual_seed(0)
    batch, positions, heads, head_dim = 64, 97, 8, 64
    cos, sin = RotaryEmbedding(head_dim, positions, 10000.0).cuda()()
    qkv = 2 * torch.randn(batch, positions, 3 * heads * head_dim, device="cuda", dtype=torch.float64)
    grad = torch.randn(batch, positions, heads * head_dim, device="cuda", dtype=torch.float64)

    results = attention_results(qkv, grad, cos, sin, heads)
    assert_as_close_to_exact(results)
    # Compiled, the operator runs as it is (the same kernels, to the bit).
    x = qkv.bfloat16().requires_grad_()
    out = torch.compile(lambda x: kernels.rope_attention(x, cos, sin, heads), fullgraph=True)(x)
    out.backward(grad.bfloat16())
    assert torch.equal(out.double(), results[2][0]) and torch.equal(x.grad.double(), results[2][1])
