"""Out-of-memory recognition, and the sizes of MPS messages recorded on real Macs (tests/fixtures/macos, §6).

Sizes are the printed two-decimal figure times 2**30 (GB, GiB) or 2**20 (MB, MiB), rounded half up: the literals
below were worked out with integer arithmetic, not with the parser.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrm.train.memory.oom import is_out_of_memory, parse_mps_oom

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "macos"
GIB, MIB = 2**30, 2**20


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# file, allocated, other, max_allowed, tried (bytes); all on the private pool
RECORDED = [
    ("mps_oom_m1_air_16gb_audioldm2.txt", 19348827668, 112302490, 19466939269, 4718592),  # 18.02 GB .. 4.50 MB
    ("mps_oom_8gb_pytorch_105839.txt", 1556925645, 7967164334, 9738838344, 590998405),  # 1.45 GB .. 563.62 MB
    ("mps_oom_m2_mbp_fooocus.txt", 9545564815, 181382676, 9738838344, 6553600),  # 8.89 GB .. 6.25 MB
    ("mps_oom_surya.txt", 7763153388, 1653562409, 9738838344, 939524096),  # 7.23 GB .. 896.00 MB
    ("mps_oom_pytorch_152351.txt", 11961483919, 7140383130, 19466939269, 393635430),  # 11.14 GB .. 375.40 MB
    ("mps_oom_rl_swarm_a.txt", 16159814451, 12788265124, 29205777613, 1245540516),  # 15.05 GB .. 1.16 GB
    ("mps_oom_rl_swarm_b.txt", 14345190769, 14785424916, 29205777613, 611393208),  # 13.36 GB .. 583.07 MB
    ("mps_oom_gib_comfyui_7440.txt", 10275709256, 18629420646, 29205777613, 306708480),  # 9.57 GiB .. 292.50 MiB
    ("mps_oom_gib_comfyui_8984.txt", 16879221473, 2527068, 19466939269, 6238439997),  # 15.72 GiB .. 5.81 GiB
]


@pytest.mark.parametrize(("name", "allocated", "other", "max_allowed", "tried"), RECORDED, ids=[r[0] for r in RECORDED])
def test_recorded_mps_messages(name, allocated, other, max_allowed, tried):
    text = fixture(name)
    expected = {"allocated": allocated, "other": other, "max_allowed": max_allowed, "tried": tried, "pool": "private"}
    assert parse_mps_oom(text) == expected
    message = text.strip().removeprefix("RuntimeError: ")  # what str(exc) holds
    assert parse_mps_oom(message) == expected
    assert is_out_of_memory(RuntimeError(message))


def test_gb_and_gib_are_the_same_unit():
    # 16 GB M1 machines: old builds print "18.13 GB", new ones "18.13 GiB" for the same limit, 1.7 (the default high
    # watermark ratio) x Metal's recommendedMaxWorkingSetSize, logged as 10922.67 MiB on those machines (§7.2).
    old = parse_mps_oom(fixture("mps_oom_m1_air_16gb_audioldm2.txt"))
    new = parse_mps_oom(fixture("mps_oom_gib_comfyui_8984.txt"))
    assert old["max_allowed"] == new["max_allowed"]
    assert abs(old["max_allowed"] - 1.7 * 10922.67 * MIB) < 0.005 * GIB  # within the printed precision
    assert abs(old["max_allowed"] - 18.13e9) > GIB  # read as 10**9 it would be a GiB off
    # 24 GB machines: 2/3 of 24 GiB recommended, x 1.7 = 27.20 GiB, printed as "27.20 GB" and "27.20 GiB"
    assert parse_mps_oom(fixture("mps_oom_rl_swarm_a.txt"))["max_allowed"] == round(27.2 * GIB)
    assert parse_mps_oom(fixture("mps_oom_gib_comfyui_7440.txt"))["max_allowed"] == round(27.2 * GIB)


def test_shared_pool_and_bytes():
    # https://github.com/pinokiocomputer/pinokio/issues/941 (MacBook Pro M1 16 GB, Sonoma 14.7.5)
    message = (
        "MPS backend out of memory (MPS allocated: 16.00 GB, other allocations: 3.31 GB, max allowed: 18.13 GB). "
        "Tried to allocate 256 bytes on shared pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit "
        "for memory allocations (may cause system failure)."
    )
    assert parse_mps_oom(message) == {
        "allocated": 16 * GIB, "other": 3554085437, "max_allowed": 19466939269, "tried": 256, "pool": "shared",
    }  # fmt: skip


def test_truncated_message():
    # https://github.com/Comfy-Org/ComfyUI/issues/2489, cut after the variable name (§6.2 lists its "6.80 GB")
    message = (
        "RuntimeError: MPS backend out of memory (MPS allocated: 5.56 GB, other allocations: 1.10 GB, max allowed: "
        "6.80 GB). Tried to allocate 768.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0"
    )
    assert parse_mps_oom(message) == {
        "allocated": 5970004541, "other": 1181116006, "max_allowed": 7301444403, "tried": 768 * MIB, "pool": "private",
    }  # fmt: skip


def test_message_without_a_limit():
    # the other branch of MPSAllocator.mm, taken with PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0: no "max allowed"
    message = (
        "MPS backend out of memory (MPS allocated: 40.00 GiB, other allocations: 1.50 GiB). "
        "Tried to allocate 2.00 KiB on private pool."
    )
    assert parse_mps_oom(message) == {
        "allocated": 40 * GIB, "other": 1610612736, "max_allowed": None, "tried": 2048, "pool": "private",
    }  # fmt: skip


@pytest.mark.parametrize(
    "message",
    [
        "",
        "CUDA out of memory. Tried to allocate 20.00 MiB",
        "MPS backend out of memory",
        "MPS backend out of memory (x)",
    ],
)
def test_not_an_mps_size_message(message):
    assert parse_mps_oom(message) is None


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.cuda.OutOfMemoryError("CUDA out of memory."),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                     "tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"),
        MemoryError(),
    ],
)  # fmt: skip
def test_out_of_memory(exc):
    assert is_out_of_memory(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
        ValueError("MPS backend out of memory"),  # the message alone is not enough: the allocator raises RuntimeError
        KeyboardInterrupt(),
        OSError(12, "Cannot allocate memory"),
    ],
)
def test_not_out_of_memory(exc):
    assert not is_out_of_memory(exc)


def test_wrapped_out_of_memory():
    try:
        try:
            raise RuntimeError(fixture("mps_oom_surya.txt").strip().removeprefix("RuntimeError: "))
        except RuntimeError as inner:
            raise ValueError("training step failed") from inner
    except ValueError as outer:
        assert is_out_of_memory(outer)


def test_cyclic_context_does_not_loop():
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert not is_out_of_memory(a)


def test_real_cpu_allocation_failure_is_recognised():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_out_of_memory(info.value)
