"""The gated SwiGLU product and the library of Hopper kernels (raytrm.fastpaths.hopper): its guards everywhere, its bits
on a Hopper GPU."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from raytrm.fastpaths import triton as kernels
from raytrm.fastpaths.hopper import gated, library
from tests.unit.fastpaths.interpreter import replace_backend

on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (on_hopper and library._nvcc() and kernels.HAVE_TRITON), reason="needs a Hopper GPU (sm_90), nvcc and Triton"
)


def test_it_serves_no_cpu_tensor_and_says_what_it_takes():
    x, w = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(256, 512, dtype=torch.bfloat16)
    assert gated.gated_why_not(x, w) is not None
    with pytest.raises(ValueError, match=r"bf16 x \[\.\.\., 512\] and w \[2 N, 512\].*got x \(4, 512\)"):
        gated.gated_swiglu(x, w)


def test_the_kernel_order_puts_each_threads_eight_columns_together_and_is_its_own_inverse():
    w = torch.arange(64, dtype=torch.float32).view(64, 1).expand(64, 512).contiguous()
    ordered = gated.kernel_order(w)
    for row in range(64):  # within each 32 rows, output column 8 q + 2 i + e sits at row 8 i + 2 q + e
        block, q, i, e = row // 32, row % 32 // 8, row % 8 // 2, row % 2
        assert ordered[block * 32 + 8 * i + 2 * q + e, 0] == row
    assert torch.equal(gated.kernel_order(ordered), w)


def test_the_down_projections_backward_takes_w_down_transposed_in_the_kernel_order_and_no_cpu_tensor():
    w_down = torch.randn(512, 256)
    ordered = gated.down_order(w_down)
    assert ordered.shape == (256, 512) and ordered.is_contiguous()
    assert torch.equal(ordered, gated.kernel_order(w_down.t().contiguous()))
    assert torch.equal(gated.kernel_order(ordered).t(), w_down)
    assert gated.down_backward_why_not(None, torch.zeros(4, 512, dtype=torch.bfloat16), w_down.bfloat16(), None)


def stand_in_library(monkeypatch: pytest.MonkeyPatch, **statuses: int) -> dict[str, tuple]:
    """A library in gated's place whose entry points (statuses' names) record their arguments in the dict returned
    and return their status, on a device of 132 multiprocessors whose current stream is 7."""
    calls: dict[str, tuple] = {}

    class Library:
        def __getattr__(self, entry: str):
            if entry not in statuses:
                raise AttributeError(entry)
            return lambda *args: calls.__setitem__(entry, args) or statuses[entry]

    monkeypatch.setattr(library, "_lib", Library())
    monkeypatch.setattr(library, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=7))
    return calls


def test_a_launch_hands_the_library_the_pointers_shapes_and_stream_and_names_a_kernel_that_fails(monkeypatch):
    # The two entry points' C signatures: four pointers, rows, inner, 512, multiprocessors, stream.
    calls = stand_in_library(monkeypatch, raytrm_swiglu_down_backward=0, raytrm_gated_swiglu=719)
    grad, gate_up = torch.zeros(5, 512, dtype=torch.bfloat16), torch.zeros(5, 512, dtype=torch.bfloat16)
    w_ordered = torch.zeros(256, 512, dtype=torch.bfloat16)
    out = gated.down_backward(grad, gate_up, w_ordered)
    assert out.shape == gate_up.shape
    pointers = (grad.data_ptr(), w_ordered.data_ptr(), gate_up.data_ptr(), out.data_ptr())
    assert calls["raytrm_swiglu_down_backward"] == (*pointers, 5, 256, 512, 132, 7)
    x, w = torch.zeros(3, 512, dtype=torch.bfloat16), torch.zeros(512, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="the gated SwiGLU kernel failed to launch: CUDA error 719"):
        gated._launch(x, w, keep_gate_up=False)
    gated_call = calls["raytrm_gated_swiglu"]
    assert gated_call[:2] == (x.data_ptr(), w.data_ptr()) and gated_call[3:] == (None, 3, 256, 512, 132, 7)


@pytest.mark.skipif(not kernels.HAVE_TRITON, reason="the down projection's operators need Triton")
def test_a_compiled_backward_hands_the_down_kernel_w_down_in_its_order_where_the_kernel_serves(monkeypatch):
    assert kernels.load()
    gate_up = torch.randn(64, 512, dtype=torch.bfloat16, requires_grad=True)
    h, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    orders = []

    def down_backward(grad, gate_up, w_ordered):  # the CUDA kernel's stand-in on this CPU
        orders.append(w_ordered)
        return torch.zeros_like(gate_up)

    replace_backend("swiglu_down_backward", "hopper", monkeypatch, why_not=lambda *args: None)
    monkeypatch.setattr(gated, "down_backward", down_backward)
    loss = torch.compile(lambda *args: kernels.swiglu_down_after_gate(*args).float().sum(), backend="aot_eager")
    loss(gate_up, h, w).backward()
    assert len(orders) == 1 and torch.equal(orders[0], gated.down_order(w.detach()))
    assert torch.equal(gate_up.grad, torch.zeros_like(gate_up))  # the stand-in's gradient reached gate_up


@pytest.mark.skipif(torch.cuda.is_available(), reason="the build's reason without a GPU")
def test_without_a_gpu_nothing_is_built_and_the_reason_is_kept():
    assert library._build() == (None, "no CUDA device")


@needs_hopper
@pytest.mark.parametrize("rows", [768 * 97, 1000, 64])
def test_on_hopper_it_gives_the_bits_of_cublas_product_then_raytrms_gate(rows):
    kernels.load()
    assert library.load(), library.why_not_built  # as a model's build does
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 512, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(2 * 1536, 512, device="cuda", generator=gen) / 512**0.5).bfloat16()
    gate_up = x @ w.t()
    h, kept = gated.gated_swiglu(x, w, keep_gate_up=True)
    assert torch.equal(kept, gate_up)
    assert torch.equal(h, kernels.swiglu_gate(gate_up, -1))
    alone, none = gated.gated_swiglu(x, w)
    assert none is None and torch.equal(alone, h)


@needs_hopper
def test_on_hopper_it_takes_leading_dimensions_and_refuses_other_widths():
    assert library.load(), library.why_not_built
    x = torch.randn(3, 97, 512, device="cuda").bfloat16()
    w = torch.randn(512, 512, device="cuda").bfloat16()
    h, _ = gated.gated_swiglu(x, w)
    assert h.shape == (3, 97, 256)
    assert torch.equal(h, gated.gated_swiglu(x.view(-1, 512), w)[0].view(3, 97, 256))
    assert gated.gated_why_not(x[..., :256].contiguous(), w[:, :256].contiguous())  # another inner dimension
    assert gated.gated_why_not(x, w[:384])  # gate and up halves of 192 columns
    assert gated.gated_why_not(x.float(), w.float())


def test_a_swiglu_off_hopper_takes_the_product_and_the_gate_apart():
    from raytrm.models.layers import SwiGLU

    mlp = SwiGLU(512, 4.0)
    x = torch.randn(2, 5, 512)
    assert gated.swiglu_why_not(x, mlp.gate_up_proj.weight, mlp.down_proj.weight)  # fp32 on a CPU
    gate_up = x @ mlp.gate_up_proj.weight.t()
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(mlp(x), (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.t())


def _swiglu_pair(seed: int):
    """A SwiGLU at TRM's Sudoku width and an input of 3 x 97 positions, on the GPU."""
    from raytrm.models.layers import SwiGLU

    torch.manual_seed(seed)
    return SwiGLU(512, 4.0).cuda(), torch.randn(3, 97, 512, device="cuda").bfloat16()


@needs_hopper
def test_on_hopper_the_swiglus_back_propagated_form_has_the_bits_of_the_product_and_gate_apart(monkeypatch):
    mlp, x = _swiglu_pair(0)
    g = torch.randn(3, 97, 512, device="cuda").bfloat16()
    assert gated.gated_why_not(x, mlp.gate_up_proj.weight) is None  # SwiGLU's build loaded it
    results, flops = {}, {}
    for enabled in (True, False):
        monkeypatch.setattr(library, "ENABLED", enabled)
        mlp.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        with FlopCounterMode(display=False) as counter:
            y = mlp.add_norm(xs, 1e-5)
            y.backward(g)
        results[enabled] = (y, xs.grad, mlp.gate_up_proj.weight.grad, mlp.down_proj.weight.grad)
        flops[enabled] = counter.get_total_flops()
    for on, off in zip(results[True], results[False], strict=True):
        assert torch.equal(on, off)
    assert flops[True] == flops[False] == 3 * 2 * (3 * 97) * 512 * (3072 + 1536)  # forward and two gradients each


@needs_hopper
def test_on_hopper_the_swiglus_no_grad_form_matches_the_fused_kernels_within_bf16_noise(monkeypatch):
    mlp, x = _swiglu_pair(1)
    then = torch.randn_like(x)
    outputs = {}
    with torch.no_grad():
        for enabled in (True, False):
            monkeypatch.setattr(library, "ENABLED", enabled)
            outputs[enabled] = (mlp.add_norm(x, 1e-5, then), mlp(x))
    for on, off in zip(outputs[True], outputs[False], strict=True):
        assert ((on.float() - off.float()).norm() / off.float().norm()) < 4e-3


@needs_hopper
@pytest.mark.parametrize(("rows", "inner"), [(768 * 97, 1536), (1000, 256), (129, 512)])
def test_on_hopper_the_down_projections_backward_kernel_gives_the_triton_kernels_bits(rows, inner):
    kernels.load()
    assert library.load(), library.why_not_built
    gen = torch.Generator(device="cuda").manual_seed(rows)
    grad = (torch.randn(rows, 512, device="cuda", generator=gen) / 50).bfloat16()
    gate_up = (2 * torch.randn(rows, 2 * inner, device="cuda", generator=gen)).bfloat16()
    w_down = (torch.randn(512, inner, device="cuda", generator=gen) / inner**0.5).bfloat16()
    h = torch.randn(rows, inner, device="cuda", generator=gen).bfloat16()
    assert gated.down_backward_why_not(grad, gate_up, w_down, h) is None
    triton = torch.ops.raytrm.swiglu_down_backward(grad, gate_up, w_down, h)
    cuda = torch.ops.raytrm.swiglu_down_backward_hopper(grad, gate_up, w_down, h, gated.down_order(w_down))
    assert torch.equal(cuda[0], triton[0]) and torch.equal(cuda[1], triton[1])
    # gate_up starting off 16 bytes (copied for the kernel's copies), and the last row block cut short
    shifted = torch.empty(gate_up.numel() + 8, device="cuda", dtype=torch.bfloat16)[1:][: gate_up.numel()]
    shifted = shifted.view_as(gate_up).copy_(gate_up)
    assert torch.equal(gated.down_backward(grad, shifted, gated.down_order(w_down)), triton[0])


@needs_hopper
def test_on_hopper_the_swiglus_backward_takes_the_down_kernel_where_it_serves(monkeypatch):
    mlp, x = _swiglu_pair(2)
    w_down = mlp.down_proj.weight.bfloat16()
    gate_up = torch.zeros(3, 97, 3072, device="cuda", dtype=torch.bfloat16)
    assert gated.down_backward_why_not(None, gate_up, w_down, None) is None
    assert gated.down_backward_why_not(None, gate_up[..., :256].contiguous(), w_down[:, :128], None)  # 128 columns
    assert gated.down_backward_why_not(None, gate_up.float(), w_down.float(), None)
    assert gated.down_backward_why_not(None, gate_up.transpose(0, 1), w_down, None)  # not contiguous
    calls = []
    launch = gated.down_backward
    monkeypatch.setattr(gated, "down_backward", lambda *args: calls.append(args) or launch(*args))
    mlp.add_norm(x.clone().requires_grad_(), 1e-5).backward(torch.randn_like(x))
    assert len(calls) == 1
    monkeypatch.setattr(gated, "DOWN_BACKWARD", False)
    mlp.add_norm(x.clone().requires_grad_(), 1e-5).backward(torch.randn_like(x))
    assert len(calls) == 1  # Triton's kernel


def test_on_a_hopper_machine_without_nvcc_it_says_what_to_install(monkeypatch, caplog):
    monkeypatch.setattr(library, "_loaded", False)
    monkeypatch.setattr(library, "_lib", None)
    monkeypatch.setattr(library, "why_not_built", None)
    monkeypatch.setattr(library, "_hopper_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(library, "_nvcc", lambda: None)
    with caplog.at_level("INFO", logger="raytrm.fastpaths.hopper.library"):
        assert not library.load()
    assert library.why_not_built == "no nvcc (set CUDA_HOME or put nvcc on PATH)"
    assert any(r.levelname == "INFO" and "no nvcc" in r.getMessage() for r in caplog.records)
