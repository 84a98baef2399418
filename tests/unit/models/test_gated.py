"""The gated SwiGLU product (raytrm.models.gated): its guards everywhere, its bits on a Hopper GPU."""

import pytest
import torch

from raytrm.models import gated, kernels

on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (on_hopper and gated._nvcc() and kernels.HAVE_TRITON),
    reason="needs a Hopper GPU, nvcc and Triton (run on the lent GPU machine)",
)


def test_it_serves_no_cpu_tensor_and_says_what_it_takes():
    x, w = torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(256, 512, dtype=torch.bfloat16)
    assert not gated.serves(x, w)
    with pytest.raises(ValueError, match=r"bf16 x \[\.\.\., 512\] and w \[2 N, 512\].*got x \(4, 512\)"):
        gated.gated_swiglu(x, w)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the build's reason without a GPU")
def test_without_a_gpu_nothing_is_built_and_the_reason_is_kept():
    assert gated._build() == (None, "no CUDA device")


@needs_hopper
@pytest.mark.parametrize("rows", [768 * 97, 1000, 64])
def test_on_hopper_it_gives_the_bits_of_cublas_product_then_raytrms_gate(rows):
    kernels.register()
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
    x = torch.randn(3, 97, 512, device="cuda").bfloat16()
    w = torch.randn(512, 512, device="cuda").bfloat16()
    h, _ = gated.gated_swiglu(x, w)
    assert h.shape == (3, 97, 256)
    assert torch.equal(h, gated.gated_swiglu(x.view(-1, 512), w)[0].view(3, 97, 256))
    assert not gated.serves(x[..., :256].contiguous(), w[:, :256].contiguous())  # another inner dimension
    assert not gated.serves(x, w[:384])  # gate and up halves of 192 columns
    assert not gated.serves(x.float(), w.float())
