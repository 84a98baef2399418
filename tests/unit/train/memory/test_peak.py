"""Peak memory of a region: it sees a transient allocation, and each region starts afresh."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import numpy as np
import pytest

from raytrm.train.memory import peak as peak_mod
from raytrm.train.memory.peak import PeakMemory

MiB = 2**20


#: Two regions measured in a process of their own: in the test session's process other threads (a shared local Ray's)
#: allocate and free at any time, and a process's resident peak counts every thread's.
REGIONS = """
import json
import numpy as np
from raytrm.train.memory.peak import PeakMemory

def transient(megabytes):
    block = np.ones(megabytes * 2**20 // 8)
    block[::4096] += 1  # touch every page
    del block

with PeakMemory() as big:
    transient(200)
with PeakMemory() as small:
    transient(20)
print(json.dumps({"big": big.bytes, "small": small.bytes, "method": big.method}))
"""


def test_peak_sees_a_transient_allocation_and_resets():
    done = subprocess.run([sys.executable, "-c", REGIONS], capture_output=True, text=True, check=True)
    found = json.loads(done.stdout)
    assert found["method"] in ("linux-vmhwm", "rss-sampled")
    assert found["big"] - found["small"] > 150 * MiB, found


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

    from raytrm.train.memory.peak import trim_heap

    def rss() -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

    blocks = [np.ones(64 * 1024 // 8) for _ in range(4000)]  # 256 MiB of small blocks: heap, not mmap
    held = rss()
    del blocks
    assert trim_heap()
    assert held - rss() > 128 * MiB


_ARENAS_AFTER_THREADS = """
import ctypes, sys, threading
from raytrm.train.memory.peak import one_heap
if sys.argv[1] == "one":
    assert one_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def allocate():
    libc.free(libc.malloc(1 << 20))
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc.malloc_stats()  # one "Arena N:" section per arena, on stderr
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc's malloc")
def test_one_heap_keeps_every_thread_on_glibcs_main_arena():
    """Without it, each new thread's first allocation makes an arena of its own (glibc's default); with it, one."""
    import subprocess
    import sys

    def arenas(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _ARENAS_AFTER_THREADS, mode], capture_output=True, text=True, check=True
        )
        return run.stderr.count("Arena ")

    assert arenas("default") > 1
    assert arenas("one") == 1
