"""Linear layers on oneDNN (raytrm.fastpaths.onednn): F.linear's values and gradients within fp32 rounding, counted as
F.linear is, and F.linear itself wherever oneDNN's linear does not serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from raytrm.fastpaths import onednn
from raytrm.models.layers import Linear

needs_onednn = pytest.mark.skipif(not onednn.ENABLED, reason="needs oneDNN's linear (torch on an x86-64 CPU)")


class OpsSeen(TorchDispatchMode):
    """Records the name of every operator dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._overloadpacket._qualified_op_name)
        return func(*args, **(kwargs or {}))


def gradients(linear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor) -> list:
    """The output of linear(x, w, b) and the gradients of x, w and b under the output gradient g."""
    leaves = [t.detach().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = linear(*leaves) if b is not None else linear(*leaves, None)
    y.backward(g)
    return [y.detach()] + [t.grad for t in leaves]


@needs_onednn
@pytest.mark.parametrize("shape", [(13, 48), (3, 11, 48)], ids=["2-D", "3-D"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_values_and_gradients_are_f_linears_within_fp32_rounding(shape, bias):
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(40, 48) / 48**0.5
    b = torch.randn(40) if bias else None
    g = torch.randn(*shape[:-1], 40)
    with OpsSeen() as seen:
        ours = gradients(onednn.linear, x, w, b, g)
    assert "mkldnn::_linear_pointwise" in seen.names  # oneDNN did the products, not a fallback
    exact = gradients(F.linear, *(t.double() if t is not None else None for t in (x, w, b, g)))
    plain = gradients(F.linear, x, w, b, g)
    for mine, mkl, want in zip(ours, plain, exact, strict=True):
        assert mine.shape == want.shape and mine.dtype == torch.float32
        # As close to the fp64 result as MKL's fp32 products are, up to the order of the sums.
        bound = 4 * (mkl.double() - want).abs().max().item() + 1e-6
        assert (mine.double() - want).abs().max().item() <= bound


@needs_onednn
def test_the_linear_layer_runs_on_onednn_in_fp32_on_a_cpu():
    layer = Linear(48, 40)
    x = torch.randn(5, 48)
    with OpsSeen() as seen:
        y = layer(x)
    assert "mkldnn::_linear_pointwise" in seen.names and "aten::mm" not in seen.names
    torch.testing.assert_close(y, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_it_serves_fp32_on_a_cpu_eagerly_and_nothing_else(monkeypatch):
    w = torch.randn(40, 48)
    assert onednn.available(torch.randn(5, 48), w) == onednn.ENABLED
    assert not onednn.available(torch.randn(5, 48, dtype=torch.float64), w.double())
    assert not onednn.available(torch.randn(5, 48, dtype=torch.bfloat16), w)
    assert not onednn.available(torch.randn(48), w)  # a vector: F.linear's
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.backends.mkldnn, "enabled", False)  # the user turned torch's oneDNN off
        assert not onednn.on() and not onednn.available(torch.randn(5, 48), w)
        if onednn.ENABLED:
            assert onednn.reason() == "torch.mm's BLAS for all (torch's oneDNN is turned off)"
    assert torch.backends.mkldnn.enabled
    assert onednn.reason().startswith("linear layers on oneDNN" if onednn.ENABLED else "torch.mm's BLAS for all")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not onednn.available(torch.randn(5, 48), w)  # inductor packs its own weights


def test_it_serves_x86_64_cpus_made_by_amd_with_a_torch_that_has_it():
    assert onednn.why_not("x86_64", True, "AuthenticAMD") is None
    assert onednn.why_not("AMD64", True, "AuthenticAMD") is None  # Windows' name for x86-64
    assert onednn.why_not("arm64", True, "") == "oneDNN's linear needs an x86-64 CPU; this is arm64"
    assert onednn.why_not("x86_64", False, "AuthenticAMD") == "this torch has no oneDNN linear"
    # MKL, Intel's own, was as fast or faster on an Intel Xeon; an unknown maker keeps it too.
    assert onednn.why_not("x86_64", True, "GenuineIntel") == (
        "oneDNN's linear beat MKL on AMD's CPUs only; this one is GenuineIntel"
    )
    assert onednn.why_not("x86_64", True, "").endswith("this one is of an unknown maker")
    assert onednn.ENABLED is (onednn.WHY_NOT is None)


def test_without_onednn_a_linear_is_f_linear_to_the_bit(monkeypatch):
    monkeypatch.setattr(onednn, "ENABLED", False)
    monkeypatch.setattr(onednn, "WHY_NOT", "oneDNN's linear needs an x86-64 CPU; this is arm64")
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 48), torch.randn(40, 48), torch.randn(40)
    with OpsSeen() as seen:
        y = onednn.linear(x, w, b)
    assert "mkldnn::_linear_pointwise" not in seen.names
    assert torch.equal(y, F.linear(x, w, b))
    assert onednn.reason() == "torch.mm's BLAS for all (oneDNN's linear needs an x86-64 CPU; this is arm64)"


@needs_onednn
def test_the_flop_counter_counts_it_as_f_linear():
    onednn.load()
    layer = Linear(48, 40)
    x = torch.randn(3, 11, 48, requires_grad=True)
    counts = []
    for enabled in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(onednn, "ENABLED", enabled)
            with FlopCounterMode(display=False) as counter:
                layer(x).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 3 * 2 * 33 * 48 * 40  # forward, and the input's and the weight's gradients


@needs_onednn
def test_a_weight_written_in_place_is_packed_again():
    torch.manual_seed(0)
    layer = Linear(48, 40)
    x = torch.randn(5, 48, requires_grad=True)

    def assert_current() -> None:
        """The layer's output and x's gradient are those of the weight's values now (not of a stale packed copy)."""
        x.grad = None
        y = layer(x)
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(y, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(5, -1), rtol=1e-5, atol=1e-5)

    assert_current()  # packed both ways now
    torch.optim.AdamW(layer.parameters(), lr=0.1).step()  # the optimizer's update
    assert_current()
    layer.load_state_dict({"weight": torch.randn(40, 48)})
    assert_current()
    # A replica's weight on the same storage (raytrm.train.side_by_side) sees the model's updates.
    replica = torch.nn.Parameter(layer.weight.detach())
    onednn.linear(x, replica)
    with torch.no_grad():
        layer.weight.mul_(-2)
    torch.testing.assert_close(onednn.linear(x, replica), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
