"""TRM-MLP's position mixing on a CPU a block of columns at a time (raytrm.fastpaths.cpu)."""

from __future__ import annotations

import pytest
import torch

from raytrm.fastpaths import cpu
from raytrm.models.layers import SwiGLU
from raytrm.models.ops import add_rms_norm


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_mixing_columns_in_blocks_equals_the_whole_matrix_formula_within_fp32_rounding(block):
    torch.manual_seed(0)
    mlp = SwiGLU(97, 4.0)
    cols = torch.randn(97, 300)
    with torch.no_grad():
        whole = add_rms_norm(cols, mlp.forward_columns(cols), 1e-5, dim=0)
        # The BLAS may sum a narrow block's products in another order (blocks of 1 and 7 do, here).
        w_gate_up, w_down = mlp.gate_up_proj.weight, mlp.down_proj.weight
        torch.testing.assert_close(cpu.mix_in_blocks(cols, w_gate_up, w_down, 1e-5, block), whole)


def test_it_serves_cpu_tensors_eagerly(monkeypatch):
    w = torch.zeros(2)
    assert cpu.mix_why_not(torch.zeros(9, 4), w, w, 1e-5) is None
    assert cpu.mix_why_not(torch.zeros(9, 4, device="meta"), w, w, 1e-5) == "not on a CPU"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert cpu.mix_why_not(torch.zeros(9, 4), w, w, 1e-5) is not None  # inductor fuses the whole formula
