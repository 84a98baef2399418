"""Worker processes joined by torch.distributed on one machine, without Ray: for tests, benchmarks and GPU checks.

Ray Train is how raytrm runs workers on a cluster; this is the same process group made by hand, so the gradient
sync can be checked where Ray is absent (a GPU machine with only PyTorch) and without Ray's start-up cost.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from raytrm.hardware import device as devices


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the fork server imports once, before it forks any worker (see _context).
PRELOAD = ["torch", "torch.distributed", "raytrm.train.trainer"]


def _context() -> Any:
    """Where the workers come from. On Linux, a fork server that imported torch once forks each (a fresh interpreter
    spends about two seconds importing torch again, per worker, per call); elsewhere fresh interpreters, as macOS's
    system frameworks do not survive a fork. A worker takes the caller's environment and working directory of the
    moment either way (_worker), not the fork server's of its start."""
    if sys.platform.startswith("linux"):
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        return context
    return mp.get_context("spawn")


def _worker(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    environment: dict[str, str],
    cwd: str,
) -> None:
    import torch.distributed as dist

    try:
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(cwd)
        # Processes that share a machine share its cores: torch's default pool in each would take them all, and
        # oversubscribed OpenMP pools stall for scheduler quanta at every parallel region. A config's threads win.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        target = torch.device(device, rank) if device == devices.CUDA else torch.device(device)
        if target.type == devices.CUDA:
            torch.cuda.set_device(target)
        dist.init_process_group(
            devices.collective_backend(target),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            device_id=target if target.type == devices.CUDA else None,
        )
        try:
            # As bytes: torch's own queue pickling shares tensors through file descriptors, which die with the child.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, target, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu", timeout_s: float = 600) -> list:
    """Run fn(rank, world_size, device, *args) in world_size new processes joined in one process group.

    fn must be importable (a module-level function). Returns the results in rank order; a rank that fails makes
    the others stop and raises with its traceback.
    """
    context = _context()
    results = context.Queue()
    port = free_port()
    here = (dict(os.environ), os.getcwd())
    procs = [
        context.Process(target=_worker, args=(rank, world_size, port, device, fn, args, results, *here), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"distributed workers gave no result within {timeout_s:.0f} s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)  # our own child's result
    finally:
        # After a rank's failure its peers may sit in a collective that never completes: a short grace, then stopped.
        grace = 30 if len(out) == world_size else 5
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world_size)]
