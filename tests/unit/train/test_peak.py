"""Peak memory of a region: it sees a transient allocation, and each region starts afresh."""

from __future__ import annotations

import numpy as np

from raytrm.train import peak as peak_mod
from raytrm.train.peak import PeakMemory

MiB = 2**20


def _transient(megabytes: int) -> None:
    block = np.ones(megabytes * MiB // 8)
    block[::4096] += 1  # touch every page
    del block


def test_peak_sees_a_transient_allocation_and_resets():
    with PeakMemory() as big:
        _transient(200)
    with PeakMemory() as small:
        _transient(20)
    assert big.method in ("linux-vmhwm", "rss-sampled")
    assert big.bytes - small.bytes > 150 * MiB


def test_sampling_fallback(monkeypatch):
    monkeypatch.setattr(peak_mod, "_vm_hwm", lambda: None)
    with PeakMemory(interval_s=0.001) as region:
        block = np.ones(100 * MiB // 8)
        block[::4096] += 1
        import time

        time.sleep(0.05)  # the sampler reads while the block is held
        del block
    assert region.method == "rss-sampled"
    assert region.bytes > 100 * MiB


def test_trim_heap_returns_freed_memory():
    import re

    from raytrm.train.peak import trim_heap

    def rss() -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

    blocks = [np.ones(64 * 1024 // 8) for _ in range(4000)]  # 256 MiB of small blocks: heap, not mmap
    held = rss()
    del blocks
    assert trim_heap()
    assert held - rss() > 128 * MiB
