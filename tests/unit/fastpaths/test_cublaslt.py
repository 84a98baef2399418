"""Products on cuBLASLt (raytrm.fastpaths.cublaslt): torch.mm's bits, forward and backward, with each shape timed once;
torch.mm wherever cuBLASLt does not serve. The layouts it hands cuBLASLt are checked here on the CPU by reading the
operands' memory as cuBLASLt does; the products themselves need a CUDA GPU."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from raytrm.fastpaths import cublaslt
from raytrm.models.layers import Linear
from tests.unit.fastpaths.test_onednn import OpsSeen

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def as_cublaslt_reads(t: torch.Tensor) -> torch.Tensor:
    """The matrix cuBLASLt multiplies for t given operand(t): the column-major [rows, cols] matrix at t's address with
    its leading dimension, transposed where the op says so. It is t^T when operand(t) is right."""
    op, rows, cols, ld = cublaslt.operand(t)
    stored = torch.as_strided(t, (rows, cols), (1, ld), t.storage_offset())
    return stored.t() if op == cublaslt._OP_T else stored


def views(rows: int, cols: int) -> dict[str, torch.Tensor]:
    """[rows, cols] views of distinct integers in every layout operand() takes."""
    values = torch.arange(rows * cols, dtype=torch.float64).view(rows, cols) % 7 - 3
    wide = torch.zeros(rows, cols + 5, dtype=torch.float64)
    wide[:, 2 : 2 + cols] = values
    tall = torch.zeros(cols, rows + 3, dtype=torch.float64)
    tall[:, 1 : 1 + rows] = values.t()
    return {
        "row-major": values.clone(),
        "column-major": values.t().contiguous().t(),
        "row-major, rows padded": wide[:, 2 : 2 + cols],
        "column-major, columns padded": tall[:, 1 : 1 + rows].t(),
    }


@pytest.mark.parametrize("shape", [(5, 3), (1, 4), (4, 1)])
def test_operand_gives_cublaslt_the_transpose_of_every_row_or_column_major_view(shape):
    for name, t in views(*shape).items():
        assert torch.equal(as_cublaslt_reads(t), t.t()), name


def test_the_product_of_the_layouts_is_the_matrix_product_for_every_pair_of_layouts():
    # out^T [N, M] = b^T a^T, column-major: out [M, N] row-major, as cuBLASLt writes it with leading dimension N.
    for a_name, a in views(6, 4).items():
        for b_name, b in views(4, 3).items():
            out_t = as_cublaslt_reads(b) @ as_cublaslt_reads(a)
            assert torch.equal(out_t.t(), a @ b), (a_name, b_name)


def test_operand_refuses_views_that_are_neither_row_nor_column_major():
    t = torch.zeros(6, 8)
    assert cublaslt.operand(t[::2, ::2]) is None
    assert cublaslt.operand(t[:, ::2]) is None
    assert cublaslt.operand(t.t()[::2]) is None


def test_off_cuda_linear_layers_keep_their_products_and_the_operator_is_torch_mm():
    x, w = torch.randn(3, 5, 8), torch.randn(4, 8)
    assert not cublaslt.serves(x, w)
    layer = Linear(8, 4)
    with OpsSeen() as seen:
        layer(x)
    assert "raytrm::mm" not in seen.names
    a = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(8, 4, requires_grad=True)
    g = torch.randn(6, 4)
    with FlopCounterMode(display=False) as counter:
        out = cublaslt.mm(a, b)
    assert counter.get_total_flops() == 2 * 6 * 8 * 4
    out.backward(g)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.mm(a2, b2).backward(g)
    assert torch.equal(out, torch.mm(a2, b2))
    assert torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)


@pytest.mark.slow
def test_compiled_the_differentiable_product_gives_torch_mms_values_and_gradients():
    a = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(6, 4)
    compiled = torch.compile(lambda x, w: cublaslt.mm(x, w.t()) * 2, fullgraph=True)
    out = compiled(a, b)
    out.backward(g)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    expected = torch.mm(a2, b2.t()) * 2
    expected.backward(g)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 512, 1536), (333, 96, 80), (1000, 64, 8)])
def test_on_cuda_products_give_torch_mms_bits_in_every_layout(shape):
    M, K, N = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(K, N, device="cuda", generator=g).bfloat16()
    for a_view in (a, a.t().contiguous().t()):
        for b_view in (b, b.t().contiguous().t()):
            assert cublaslt.available(a_view, b_view)
            assert torch.equal(torch.ops.raytrm.mm(a_view, b_view), torch.mm(a_view, b_view))
    # An operand that starts 2 bytes past an allocation's start: its own plan, for that alignment.
    offset = torch.randn(M * K + 1, device="cuda", generator=g).bfloat16()[1:].view(M, K)
    assert torch.equal(torch.ops.raytrm.mm(offset, b), torch.mm(offset, b))


@needs_cuda
def test_on_cuda_each_shape_is_timed_once_and_its_choice_logged(caplog):
    a = torch.randn(2048, 256, device="cuda").bfloat16()
    b = torch.randn(256, 768, device="cuda").bfloat16()
    before = len(cublaslt._plans)
    with caplog.at_level(logging.INFO, logger="raytrm.fastpaths.cublaslt"):
        first = torch.ops.raytrm.mm(a, b)
        again = torch.ops.raytrm.mm(a, b)
    assert len(cublaslt._plans) == before + 1
    assert [r.getMessage() for r in caplog.records if "[2048 x 256] @ [256 x 768] (bfloat16)" in r.getMessage()]
    assert len([r for r in caplog.records if "[2048 x 256] @ [256 x 768]" in r.getMessage()]) == 1
    assert torch.equal(first, again) and torch.equal(first, torch.mm(a, b))


@needs_cuda
def test_on_cuda_linear_layers_run_the_operator_with_f_linears_bits_forward_and_backward():
    layer = Linear(512, 1536).cuda()
    x = torch.randn(8, 97, 512, device="cuda").bfloat16().requires_grad_()
    w = layer.weight
    g = torch.randn(8, 97, 1536, device="cuda").bfloat16()
    with OpsSeen() as seen:
        y = layer(x)
    assert "raytrm::mm" in seen.names
    y.backward(g)
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    y2 = F.linear(x2, w2.bfloat16())
    y2.backward(g)
    assert torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(w.grad, w2.grad)


@needs_cuda
def test_on_cuda_linear_layers_pad_outputs_off_multiples_of_8_and_keep_torchs_products_for_such_inputs():
    x = torch.randn(4, 97, device="cuda").bfloat16()
    assert cublaslt.serves(x[:, :96], torch.empty(512, 96, device="cuda").bfloat16())
    assert not cublaslt.serves(x, torch.empty(512, 97, device="cuda").bfloat16())
    assert not cublaslt.serves(x[:, :96], torch.empty(11, 96, device="cuda").bfloat16())
    torch.manual_seed(0)
    x = torch.randn(3, 50, 512, device="cuda").bfloat16()
    # 11 outputs (TRM's vocabulary) come from a weight padded with zero rows to 16, which the operator serves; 2
    # with a bias (TRM's halting head) from torch's product with both padded to 8. Outputs and gradients are the
    # plain layer's, within a rounding.
    for outputs, bias, operator in ((11, False, True), (2, True, False)):
        layer = Linear(512, outputs, bias=bias).cuda()
        with torch.no_grad():
            layer.weight.normal_()
            if bias:
                layer.bias.normal_()
        grad = torch.randn(3, 50, outputs, device="cuda").bfloat16()
        xs = [x.clone().requires_grad_() for _ in range(2)]
        with OpsSeen() as seen:
            y = layer(xs[0])
        assert ("raytrm::mm" in seen.names) == operator
        assert y.shape == (3, 50, outputs)
        y.backward(grad)
        padded = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        plain = F.linear(xs[1], layer.weight.bfloat16(), None if layer.bias is None else layer.bias.bfloat16())
        plain.backward(grad)
        torch.testing.assert_close(y, plain)
        torch.testing.assert_close(xs[0].grad, xs[1].grad)
        for a, b in zip(padded, [p.grad for p in layer.parameters()], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    # An input width off a multiple of 8 stays with torch's product.
    with OpsSeen() as seen:
        Linear(97, 16).cuda()(torch.randn(3, 97, device="cuda").bfloat16())
    assert "raytrm::mm" not in seen.names


@needs_cuda
def test_on_cuda_a_shape_first_met_inside_a_graph_capture_runs_torch_mm_there():
    a = torch.randn(640, 320, device="cuda").bfloat16()
    b = torch.randn(320, 192, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.mm(a, b)  # cuBLAS's own warm-up, outside the capture
    torch.cuda.synchronize()
    plans = len(cublaslt._plans)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.raytrm.mm(a, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.mm(a, b))
    assert len(cublaslt._plans) == plans  # nothing timed inside the capture
    torch.ops.raytrm.mm(a, b)
    assert len(cublaslt._plans) == plans + 1  # outside it the shape is timed


@needs_cuda
def test_on_cuda_a_compiled_linear_gives_the_eager_bits():
    layer = Linear(256, 512).cuda()
    x = torch.randn(4, 33, 256, device="cuda").bfloat16()
    compiled = torch.compile(lambda t: layer(t), fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
