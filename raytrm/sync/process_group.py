"""Gradient sync over a torch.distributed process group: the sync object (raytrm.sync.contract's contract) that every
data-parallel worker hands its Trainer, set up by Ray Train or, without Ray, by `raytrm.distributed.launch`.

Compressed (`set_compression(True)`), each bucket travels in bf16 with error feedback: what the rounding leaves out
of a worker's gradient stays in that worker's residual and is added to its next gradient, so over the steps every
worker sends the sum of its gradients, less only the residual it holds at the end.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from raytrm.constants import GLOO_IFNAME_ENV
from raytrm.hardware import device as devices
from raytrm.sync.membership import group_timeout, set_group_timeout

logger = logging.getLogger(__name__)


class ProcessGroupSync:
    """Sync over an initialised torch.distributed group: gloo on CPU (MPS staged through CPU buffers), NCCL on CUDA.

    Gradients travel as flat buckets of about `bucket_mb` MiB, in reverse parameter order (the order a backward pass
    finishes them), all issued asynchronously and then awaited, so gloo pipelines them. The flat buffers are
    allocated once and reused every step. `overlapped` launches the same buckets during a backward pass instead
    (unless `overlap` is off); that needs buckets well below a model's size, hence 4 MiB rather than DDP's 25: the
    all-reduce of the reference TRM's 19 MiB took about as long in 4 MiB buckets as in one here (loopback gloo).
    """

    def __init__(
        self, device: torch.device, bucket_mb: float = 4.0, group: Any = None, *, overlap: bool = True
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupSync needs torch.distributed initialised (Ray Train or launch.spawn)")
        self.dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        #: The network interface this worker's sums go through: the one gloo binds (GLOO_SOCKET_IFNAME, set where a
        #: cluster's run chose the fastest path), None where the host's routes choose it or the backend is not gloo.
        self.interface = os.environ.get(GLOO_IFNAME_ENV) if dist.get_backend(group) == "gloo" else None
        self.device = device
        self.comm_device = devices.collective_device(device)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._buckets: list[Bucket] | None = None
        self.overlap = overlap
        # Gradients are copied off the device (MPS) for gloo: those copies must land before the collective reads them.
        self._staged = self.comm_device != device
        #: Compressed: the dtype gradients travel in (None: exact, in their own dtype).
        self.wire_dtype: torch.dtype | None = None
        self._residual: torch.Tensor | None = None  # a resumed residual, until the buckets are planned
        self._sums: dict[tuple[int, ...], list[Flat]] = {}
        # The group sum_tensors' sums travel in, made at the first: a group's collectives share its connections and
        # leave in the order issued, so the small exchanges issued while a round's sum travels would queue behind it.
        self._bulk: Any = None

    # -- gradients ---------------------------------------------------------------------------------------------------

    def buckets(self, params: Sequence[torch.nn.Parameter]) -> list[Bucket]:
        """The parameters that take gradients, last first, grouped by dtype into buckets (planned once)."""
        if self._buckets is None:
            groups: list[list[torch.nn.Parameter]] = []
            current: list[torch.nn.Parameter] = []
            size = 0
            for p in reversed([p for p in params if p.requires_grad]):
                if current and (p.dtype != current[0].dtype or size + p.numel() * p.element_size() > self.bucket_bytes):
                    groups.append(current)
                    current, size = [], 0
                current.append(p)
                size += p.numel() * p.element_size()
            if current:
                groups.append(current)
            self._buckets = [Bucket(group, self.comm_device) for group in groups]
            if self._residual is not None:
                self.load_compression_state(self._residual)
        return self._buckets

    def launch(self, bucket: Bucket) -> Any:
        """Copy a bucket's gradients into its flat buffer and start summing it over the workers (compressed: its
        rounding to the wire dtype, with what earlier rounds left unsent)."""
        bucket.fill()
        if self._staged:
            devices.synchronize(self.device)
        return self.dist.all_reduce(bucket.prepare(self.wire_dtype), group=self.group, async_op=True)

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> float:
        """Sum every parameter's gradient over the workers, in place; returns the seconds it took.

        A parameter without a gradient on this worker counts as zeros, so every rank sends the same buckets.
        """
        start = time.perf_counter()
        buckets = self.buckets(params)
        pending = [self.launch(bucket) for bucket in buckets]
        for work, bucket in zip(pending, buckets, strict=True):
            work.wait()
            bucket.unfill()
            bucket.commit()
        devices.synchronize(self.device)
        return time.perf_counter() - start

    # -- compression -------------------------------------------------------------------------------------------------

    def set_compression(self, on: bool) -> None:
        """Sum gradients in bf16 with error feedback (every rank switches at the same step), or exactly again: the
        first exact sum then carries what the residuals held."""
        self.wire_dtype = self._wire_dtype() if on else None

    def _wire_dtype(self) -> torch.dtype:
        """bf16 where the backend sums it (gloo does in torch 2.x), else fp16: one probe, the same on every rank."""
        probe = torch.ones(1, dtype=torch.bfloat16, device=self.comm_device)
        try:
            self.dist.all_reduce(probe, group=self.group)
        except (RuntimeError, ValueError, TypeError) as error:
            logger.warning("the collective backend does not sum bf16 (%s): compressed gradients travel in fp16", error)
            return torch.float16
        return torch.bfloat16

    def compression_state(self) -> torch.Tensor | None:
        """This worker's residual, the buckets' in plan order (None before any compressed sum)."""
        if self._buckets is None:
            return self._residual
        if all(b.residual is None for b in self._buckets):
            return None
        return torch.cat([b.residual if b.residual is not None else torch.zeros_like(b.flat) for b in self._buckets])

    def load_compression_state(self, residual: torch.Tensor | None) -> None:
        """Continue with a saved residual (applied once the buckets are planned, at the first sum)."""
        if self._buckets is None:
            self._residual = residual
            return
        self._residual = None
        sizes = [b.flat.numel() for b in self._buckets]
        if residual is not None and residual.numel() != sum(sizes):
            raise ValueError(f"a residual of {residual.numel()} values for gradient buckets of {sum(sizes)}")
        parts = residual.split(sizes) if residual is not None else [None] * len(sizes)
        for bucket, part in zip(self._buckets, parts, strict=True):
            bucket.residual = None if part is None else part.to(bucket.flat.device, bucket.flat.dtype).clone()

    # -- tensors -----------------------------------------------------------------------------------------------------

    def sum_tensors(self, tensors: Sequence[torch.Tensor]) -> TensorSum:
        """Start summing the tensors over the workers, in place (in flat buckets, staged off MPS); wait() on the result
        before reading them. The buckets are kept for the same tensors (a round's deltas: every round)."""
        key = tuple(id(t) for t in tensors)
        if key not in self._sums:
            if len(self._sums) >= 4:
                self._sums.clear()
            self._sums[key] = [Flat(group, self.comm_device) for group in _groups(list(tensors), self.bucket_bytes)]
        if self._bulk is None:  # every rank is here at the same point: a collective
            ranks = None if self.group is None else self.dist.get_process_group_ranks(self.group)
            # Bounded as the group's own collectives are (torch would give it its 30-minute default): a peer asleep
            # while a round's sum travels costs the others the run's deadline, not half an hour.
            self._bulk = self.dist.new_group(ranks=ranks, timeout=group_timeout(self.group, self.comm_device))
        return TensorSum(self, self._sums[key], self._bulk)

    def overlapped(self, params: Sequence[torch.nn.Parameter]) -> OverlappedBuckets | None:
        """An all-reduce whose buckets start while a backward pass is still computing the rest (see the class);
        None where overlap is off, or where the gradient fills one bucket (LoRA's adapters): that bucket could leave
        only once the backward ends, so overlapping would hide nothing, and a step that overlaps runs its
        micro-batches one after another rather than side by side on a CPU's threads."""
        if not self.overlap or len(self.buckets(params)) < 2:
            return None
        return OverlappedBuckets(self, params)

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

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every worker's picklable object, in rank order (a few events: not for tensors or every step)."""
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_slots(self, local: torch.Tensor, part: slice, total: int) -> torch.Tensor:
        """The whole global batch's slots of a per-slot tensor, from each worker's own slots (exact: x + 0 = x)."""
        wide = torch.int32 if local.dtype == torch.bool else local.dtype
        full = torch.zeros((total, *local.shape[1:]), dtype=wide, device=self.comm_device)
        full[part] = local.to(self.comm_device, wide)
        self.dist.all_reduce(full, group=self.group)
        return full.to(local.device, local.dtype)

    def any(self, flag: bool) -> bool:
        return self.sum_floats([1.0 if flag else 0.0])[0] > 0

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank src's object on every rank (a checkpoint read on rank 0's disk, say)."""
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, group=self.group, device=self.comm_device)
        return box[0]

    # -- deadlines and membership ------------------------------------------------------------------------------------

    def set_timeout(self, seconds: float) -> None:
        """Bound every collective of this sync's groups (the bulk sums' too) by `seconds` from now on: a deadline
        measured during the run, taken on the live groups by every rank at the same boundary."""
        set_group_timeout(seconds, self.group)  # None: the default group
        if self._bulk is not None:
            set_group_timeout(seconds, self._bulk)

    def regrouped(self) -> None:
        """The default group was made anew for another set of workers (raytrm.sync.membership): this worker's rank
        and the group's size are read again, and the group the bulk sums travel in is made again at the next one.
        The buckets and their residuals stay: they are this worker's, whoever its peers."""
        if self.group is not None:
            raise RuntimeError("a ProcessGroupSync over a subgroup cannot follow a change of membership")
        self.rank, self.world_size = self.dist.get_rank(), self.dist.get_world_size()
        self._bulk = None


def _groups(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, about `limit` bytes a group."""
    groups: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if not groups or t.dtype != groups[-1][0].dtype or size + t.numel() * t.element_size() > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.numel() * t.element_size()
    return groups


class Flat:
    """Tensors summed together in one flat buffer on the collective's device."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        self.tensors = tensors
        self.flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=device)
        bounds = list(itertools.accumulate((t.numel() for t in tensors), initial=0))
        self.views = [self.flat[a:b] for a, b in itertools.pairwise(bounds)]

    def fill(self) -> None:
        for t, view in zip(self.tensors, self.views, strict=True):
            view.copy_(t.reshape(-1), non_blocking=True)

    def unfill(self) -> None:
        for t, view in zip(self.tensors, self.views, strict=True):
            t.copy_(view.view_as(t), non_blocking=True)


class TensorSum:
    """The sum of ProcessGroupSync.sum_tensors, in flight (raytrm.sync.contract.PendingSum)."""

    def __init__(self, sync: ProcessGroupSync, flats: list[Flat], group: Any) -> None:
        self.sync, self.flats = sync, flats
        for flat in flats:
            flat.fill()
        if sync._staged:
            devices.synchronize(sync.device)
        self.works = [sync.dist.all_reduce(f.flat, group=group, async_op=True) for f in flats]

    def wait(self) -> float:
        """Wait for the sum and write it into the tensors; returns the seconds waited."""
        begin = time.perf_counter()
        for work, flat in zip(self.works, self.flats, strict=True):
            work.wait()
            flat.unfill()
        devices.synchronize(self.sync.device)
        self.works = []
        return time.perf_counter() - begin


class Bucket:
    """Parameters whose gradients travel together, and the flat buffer (on the collective's device) they travel in.

    Compressed, a bucket also holds the buffer that travels (`wire`, bf16) and its error feedback (`residual`,
    fp32: what earlier rounds' rounding left unsent); the sum of a round reaches the residual only at `commit`, so a
    round abandoned part-way (raytrm.sync.contract.OverlappedAllReduce.abandon) leaves it as it was.
    """

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.residual: torch.Tensor | None = None
        self.wire: torch.Tensor | None = None
        self._sent = self.flat  # the buffer the latest round summed

    def prepare(self, wire_dtype: torch.dtype | None) -> torch.Tensor:
        """After `fill`: add what earlier rounds left unsent; compressed, round it into `wire` and keep the rounding
        in `flat` (the next residual, once committed). Returns the buffer to sum."""
        if self.residual is not None:
            self.flat.add_(self.residual)
        if wire_dtype is None:
            self._sent = self.flat
            return self.flat
        if self.wire is None or self.wire.dtype != wire_dtype:
            self.wire = torch.empty(self.flat.shape, dtype=wire_dtype, device=self.flat.device)
        self.wire.copy_(self.flat)
        self.flat.sub_(self.wire)  # exact: a float less its own rounding to fewer bits
        self._sent = self.wire
        return self.wire

    def commit(self) -> None:
        """The round's sum was kept: compressed, its rounding becomes the residual; exact, nothing is left unsent."""
        if self._sent is self.flat:
            self.residual = None
            return
        if self.residual is None:
            self.residual = torch.empty_like(self.flat)
        self.residual, self.flat = self.flat, self.residual

    def _views(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        out, offset = [], 0
        for p in self.params:
            out.append((p, self.flat[offset : offset + p.numel()]))
            offset += p.numel()
        return out

    def fill(self) -> None:
        """The parameters' gradients into the buffer (zeros for one without a gradient here)."""
        for p, view in self._views():
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1), non_blocking=True)

    def unfill(self) -> None:
        """The summed buffer back into the parameters' gradients."""
        offset = 0
        for p in self.params:
            view = self._sent[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = view.to(p.device, p.dtype, copy=True)
            else:
                p.grad.copy_(view, non_blocking=True)


class OverlappedBuckets:
    """The overlapped all-reduce (raytrm.sync.contract.OverlappedAllReduce) of ProcessGroupSync's buckets, started
    during the backward of a step's last micro-batch, bucket by bucket.

    A parameter's gradient is final once the last micro-batch's backward has accumulated into it (its
    post-accumulate-grad hook). A bucket starts when all its parameters are final and every bucket before it has
    started: the order is fixed (the sync object's plan), so every rank issues the same collectives in the same
    order whatever its share or cuts, and a rank with no samples this step simply starts them all in `finish`. A
    transformer finishes most of its gradient long before its backward ends, so the sum travels while the rest
    computes; TRM's one network is final only at the end, so TRM does not arm this (raytrm.families.trm).

    The summed buffers reach the gradients only at `commit`. A rank whose allocator fails mid-step calls `abandon`,
    which starts the buckets it had not, so its peers' collectives are all matched, and redoes its samples alone;
    the ranks learn of it in the metric sum that follows and all sum their gradients again (`all_reduce_gradients`),
    which the ranks that did not fail do from their untouched gradients.

    Round by round: `start`, `arm` before the last micro-batch, then `finish` and `commit`, or `abandon`.
    """

    def __init__(self, sync: ProcessGroupSync, params: Sequence[torch.nn.Parameter]) -> None:
        self.sync = sync
        self.buckets = sync.buckets(params)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._final) for b in self.buckets for p in b.params]
        self._armed = False
        self._missing: list[int] = []
        self._pending: list[Any] = []
        #: Bytes of gradient that started while the backward was still computing others, in the latest round; and
        #: all the bytes of a round.
        self.overlapped_bytes = 0
        self.total_bytes = sum(b.nbytes for b in self.buckets)

    def start(self) -> None:
        """A new step: nothing started yet, every parameter waits for its last micro-batch."""
        self._armed = False
        self._missing = [len(b.params) for b in self.buckets]
        self._pending = []
        self.overlapped_bytes = 0

    def arm(self) -> None:
        """The next backward is the step's last on this rank: start each bucket as soon as it is final."""
        self._armed = True

    def _final(self, param: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        self._missing[self._bucket_of[id(param)]] -= 1
        while len(self._pending) < len(self.buckets) and self._missing[len(self._pending)] == 0:
            k = len(self._pending)
            if any(self._missing[k + 1 :]):  # gradients still being computed: this bucket travels meanwhile
                self.overlapped_bytes += self.buckets[k].nbytes
            self._pending.append(self.sync.launch(self.buckets[k]))

    def _drain(self) -> None:
        self._armed = False
        while len(self._pending) < len(self.buckets):
            self._pending.append(self.sync.launch(self.buckets[len(self._pending)]))
        for work in self._pending:
            work.wait()

    def finish(self) -> float:
        """Start what the backward did not (final now), wait for every bucket; returns the seconds waited."""
        begin = time.perf_counter()
        self._drain()
        return time.perf_counter() - begin

    def abandon(self) -> None:
        """This rank failed part-way: match the peers' collectives with whatever the buffers hold, keep nothing."""
        self._drain()
        self.overlapped_bytes = 0

    def commit(self) -> None:
        """The summed gradients into the parameters (every rank's step succeeded)."""
        for bucket in self.buckets:
            bucket.unfill()
            bucket.commit()
        devices.synchronize(self.sync.device)

    def close(self) -> None:
        """Remove the hooks from the parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
