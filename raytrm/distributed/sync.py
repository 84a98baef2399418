"""Gradient sync between data-parallel workers of unequal speed, as one object the Trainer is handed.

The Trainer never imports Ray or calls torch.distributed itself: it asks its sync object to sum gradients, gather the
puzzle embedding's sparse rows, sum metrics and move carry slots. `LocalSync` is the one-process case (every call
returns its input); `ProcessGroupSync` does the same over a torch.distributed process group, which Ray Train (or
`raytrm.distributed.launch` without Ray) sets up.

Every worker divides its loss by the whole global batch's count (the task's rule), so worker i's gradient is already
(b_i / B) g_i and the exact global gradient is a plain sum: no weights to get wrong, whatever the shares.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from raytrm.hardware import device as devices


class GradientSync(Protocol):
    """What the Trainer needs from its peers; every method is a collective that every rank calls in the same order."""

    rank: int
    world_size: int

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> float: ...
    def gather_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def sum_floats(self, values: Sequence[float]) -> list[float]: ...
    def gather_floats(self, values: Sequence[float]) -> list[list[float]]: ...
    def gather_slots(self, local: torch.Tensor, part: slice, total: int) -> torch.Tensor: ...
    def any(self, flag: bool) -> bool: ...
    def broadcast_object(self, obj: Any) -> Any: ...


class LocalSync:
    """One worker: nothing to exchange."""

    rank, world_size = 0, 1

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> float:
        return 0.0

    def gather_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ids, grads

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        return [list(values)]

    def gather_slots(self, local: torch.Tensor, part: slice, total: int) -> torch.Tensor:
        return local

    def any(self, flag: bool) -> bool:
        return flag

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class ProcessGroupSync:
    """Sync over an initialised torch.distributed group: gloo on CPU (MPS staged through CPU buffers), NCCL on CUDA.

    Gradients travel as flat buckets of about `bucket_mb` MiB, all issued asynchronously and then awaited, so gloo
    pipelines them. The flat buffers are allocated once and reused every step.
    """

    def __init__(self, device: torch.device, bucket_mb: float = 25.0, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupSync needs torch.distributed initialised (Ray Train or launch.spawn)")
        self.dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = device
        self.comm_device = devices.collective_device(device)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._buckets: list[tuple[list[torch.nn.Parameter], torch.Tensor]] | None = None
        # Gradients are copied off the device (MPS) for gloo: those copies must land before the collective reads them.
        self._staged = self.comm_device != device

    # -- gradients ---------------------------------------------------------------------------------------------------

    def _plan(self, params: Sequence[torch.nn.Parameter]) -> list[tuple[list[torch.nn.Parameter], torch.Tensor]]:
        """Group parameters (in order, by dtype) into buckets, each with its reusable flat buffer."""
        buckets, current, size = [], [], 0
        for p in params:
            if current and (p.dtype != current[0].dtype or size + p.numel() * p.element_size() > self.bucket_bytes):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(current)
        plan = []
        for bucket in buckets:
            flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=self.comm_device)
            plan.append((bucket, flat))
        return plan

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> float:
        """Sum every parameter's gradient over the workers, in place; returns the seconds it took.

        A parameter without a gradient on this worker counts as zeros, so every rank sends the same buckets.
        """
        start = time.perf_counter()
        params = [p for p in params if p.requires_grad]
        if self._buckets is None:
            self._buckets = self._plan(params)
        pending = []
        for bucket, flat in self._buckets:
            offset = 0
            for p in bucket:
                view = flat[offset : offset + p.numel()]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1), non_blocking=True)
                offset += p.numel()
            if self._staged:
                devices.synchronize(self.device)
            pending.append(self.dist.all_reduce(flat, group=self.group, async_op=True))
        for work, (bucket, flat) in zip(pending, self._buckets, strict=True):
            work.wait()
            offset = 0
            for p in bucket:
                view = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.to(p.device, copy=True)
                else:
                    p.grad.copy_(view, non_blocking=True)
                offset += p.numel()
        devices.synchronize(self.device)
        return time.perf_counter() - start

    def gather_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every worker's (ids, row gradients) of a sparse table, concatenated in rank order."""
        home = grads.device
        ids, grads = ids.to(self.comm_device), grads.to(self.comm_device)
        counts = self._all_gather(torch.tensor([ids.shape[0]], dtype=torch.int64, device=self.comm_device))
        most = int(max(int(c) for c in counts))
        if most == 0:
            return ids.to(home), grads.to(home)
        padded_ids = ids.new_zeros(most)
        padded_ids[: ids.shape[0]] = ids
        padded = grads.new_zeros(most, grads.shape[1])
        padded[: grads.shape[0]] = grads
        all_ids, all_grads = self._all_gather(padded_ids), self._all_gather(padded)
        keep = [slice(0, int(c)) for c in counts]
        return (
            torch.cat([i[k] for i, k in zip(all_ids, keep, strict=True)]).to(home),
            torch.cat([g[k] for g, k in zip(all_grads, keep, strict=True)]).to(home),
        )

    # -- small exchanges ---------------------------------------------------------------------------------------------

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.comm_device)
        self.dist.all_reduce(t, group=self.group)
        return t.tolist()

    def gather_floats(self, values: Sequence[float]) -> list[list[float]]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.comm_device)
        return [row.tolist() for row in self._all_gather(t)]

    def gather_slots(self, local: torch.Tensor, part: slice, total: int) -> torch.Tensor:
        """The whole global batch's slots of a per-slot tensor, from each worker's own slots (exact: x + 0 = x)."""
        wide = torch.int32 if local.dtype == torch.bool else local.dtype
        full = torch.zeros((total, *local.shape[1:]), dtype=wide, device=self.comm_device)
        full[part] = local.to(self.comm_device, wide)
        self.dist.all_reduce(full, group=self.group)
        return full.to(local.device, local.dtype)

    def any(self, flag: bool) -> bool:
        return self.sum_floats([1.0 if flag else 0.0])[0] > 0

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's object on every rank (a checkpoint read on rank 0's disk, say)."""
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.group, device=self.comm_device)
        return box[0]
