"""The one device module: choices and their reasons on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from raytrm.errors import UserError
from raytrm.hardware import device


def test_auto_picks_the_cpu_here():
    assert device.pick_device("auto").type == "cpu"


def test_unavailable_device_is_a_user_error():
    with pytest.raises(UserError, match="'cuda' was asked for but is not available here"):
        device.pick_device("cuda")


def test_dtype_choices():
    cpu = torch.device("cpu")
    assert device.pick_dtype(cpu, "auto") is torch.float32
    assert device.pick_dtype(cpu, "bfloat16") is torch.bfloat16
    assert device.loss_dtype(cpu) is torch.float64
    assert device.loss_dtype(torch.device("mps")) is torch.float32
    assert device.collective_backend(cpu) == "gloo"
    # gloo cannot reduce MPS tensors: their collectives are staged through the CPU
    assert device.collective_device(torch.device("mps")) == cpu
    assert device.collective_device(cpu) == cpu
