"""Micro-batches on a CPU, side by side: each thread runs its own micro-batches whole, with one intra-op thread.

PyTorch runs each operation of a step on all threads in turn: a product splits its output one way, the SiLU after
it another, so every operation reads what another core wrote, and the threads meet at a barrier between
operations: TRM's mixing operations are small enough that the barriers and the cache traffic, not the arithmetic,
set their time. Here the step's slots are split into one contiguous share per thread; a thread runs the forward and
backward of its share's micro-batches, one after another, on a replica of the model whose parameters share the
model's storage, so its data stays in its own core's cache and nothing waits for another thread until the end.

The gradient is the same sum, in a fixed order: each replica accumulates its own micro-batches in order, then the
replicas' gradients are added to the model's in thread order (and the sparse embedding's rows handed over in that
order), so a run repeats bit for bit. Peak memory is unchanged: the threads' micro-batches in flight together are
the configured micro-batch (the memory governor's), never more.

It needs OpenMP as ATen's parallel backend and MKL's BLAS (oneDNN, raytrm.fastpaths.onednn, uses the same OpenMP),
where one thread's `torch.set_num_threads(1)` is that thread's alone; elsewhere (on a GPU, compiled, with one
thread, or under a FLOP counter or a profiler that sees one thread's operations) micro-batches run one after
another. A profiler watching all threads (`python -m benchmarks trm --breakdown`) sees them side by side.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import nn

from raytrm.models.layers import SparseEmbedding
from raytrm.train.memory.fit import even

T = TypeVar("T")


def available(device: torch.device, compiled: bool) -> bool:
    """Whether micro-batches can run one per thread here; the Trainer also needs torch to have several threads then."""
    return (
        device.type == "cpu"
        and not compiled
        and torch.backends.openmp.is_available()
        and torch.backends.mkl.is_available()
    )


def observed() -> bool:
    """Whether something on this thread watches the operations: a dispatch mode (torch's FLOP counter) or the
    profiler. Either sees only its own thread's, so micro-batches then run there, one after another. (A profiler
    started to watch all threads is not enabled on this thread: it needs no fallback.)"""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._autograd._profiler_enabled()


def side_by_side(local_batch: int, micro_batch: int, threads: int) -> int:
    """How many threads run micro-batches side by side: no more than the slots, nor than one micro-batch's slots (a
    micro-batch of 1, say under memory pressure, runs one slot at a time on all of torch's threads)."""
    return max(1, min(threads, local_batch, micro_batch))


def plan(local_batch: int, micro_batch: int, threads: int, costs: Sequence[int] | None = None) -> list[list[slice]]:
    """Each thread's micro-batches, as slices of the local slots. The slots are dealt out in contiguous shares, and
    the micro-batch's slots among the threads, both as evenly as possible (the larger first); each thread runs its
    share in micro-batches of its part (the last may be smaller). A share is never smaller than its part, so the
    micro-batches in flight at once add up to the configured micro-batch, never more: the peak the memory model
    fits against the micro-batch is the peak side by side.

    costs: what each slot costs where slots differ (an hf classifier's records: their tokens, each micro-batch cut
    to its longest). Where one micro-batch holds every slot, each thread's share is then one micro-batch and the
    shares are cut where their padded costs are most even (`balanced_shares`), not their counts: the slots come
    sorted longest first, and equal counts would leave one thread all the long records while the others wait. The
    micro-batches in flight still add up to the micro-batch, and no share pads past the longest record.
    """
    threads = side_by_side(local_batch, micro_batch, threads)
    if costs is not None and threads > 1 and micro_batch >= local_batch:
        return [[share] for share in balanced_shares(costs, threads)]
    starts = itertools.accumulate(even(local_batch, threads), initial=0)
    groups = []
    for (start, stop), part in zip(itertools.pairwise(starts), even(micro_batch, threads), strict=True):
        whole, rest = divmod(stop - start, part)
        bounds = itertools.accumulate([part] * whole + ([rest] if rest else []), initial=start)
        groups.append([slice(a, b) for a, b in itertools.pairwise(bounds)])
    return groups


def padded_cost(costs: Sequence[int], share: slice) -> int:
    """A share run as one micro-batch: its slots, each padded to the costliest of them."""
    return (share.stop - share.start) * max(costs[share], default=0)


def balanced_shares(costs: Sequence[int], threads: int) -> list[slice]:
    """At most `threads` contiguous shares of the slots whose largest padded cost is the least any such cut gives.

    The least cap under which a greedy cut (each share as long as it stays under the cap) needs no more shares than
    threads, found by bisection: a share's padded cost only grows as it takes in more slots, so the greedy cut needs
    the fewest shares for a cap. Equal costs give even counts, the larger first.
    """
    costs = [int(c) for c in costs]

    def greedy(cap: int) -> list[slice]:
        shares, start = [], 0
        while start < len(costs):
            stop, top = start + 1, costs[start]
            while stop < len(costs) and (stop + 1 - start) * max(top, costs[stop]) <= cap:
                top = max(top, costs[stop])
                stop += 1
            shares.append(slice(start, stop))
            start = stop
        return shares

    low, high = max(costs, default=0), len(costs) * max(costs, default=0)
    while low < high:
        cap = (low + high) // 2
        if len(greedy(cap)) <= threads:
            high = cap
        else:
            low = cap + 1
    return greedy(low)


def _replica(model: nn.Module) -> nn.Module:
    """A copy of model whose parameters are new leaves on the model's storage and whose buffers are the model's."""
    memo: dict[int, object] = {
        id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in model.parameters()
    }
    memo.update({id(b): b for b in model.buffers()})
    replica = copy.deepcopy(model, memo)
    for module in replica.modules():
        if isinstance(module, SparseEmbedding):
            module.clear_grad()  # rows gathered by the model are the model's to hand to its optimizer
    return replica


def _shares_storage(model: nn.Module, replica: nn.Module) -> bool:
    pairs = zip(model.parameters(), replica.parameters(), strict=True)
    return all(p.data_ptr() == r.data_ptr() and p.shape == r.shape and p.dtype == r.dtype for p, r in pairs)


class ThreadedMicroBatches:
    """Runs a step's micro-batches one share per thread (see the module's notes) and gathers their gradients."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._replicas: list[nn.Module] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def models(self, count: int) -> list[nn.Module]:
        """The model and count - 1 replicas, made again if the model's parameters moved to new storage."""
        if self._replicas and not all(_shares_storage(self.model, r) for r in self._replicas):
            self._replicas = []
        while len(self._replicas) < count - 1:
            self._replicas.append(_replica(self.model))
        for replica in self._replicas:
            replica.train(self.model.training)
        return [self.model, *self._replicas[: count - 1]]

    def run(self, groups: list[list[slice]], micro_step: Callable[[nn.Module, slice], T]) -> list[T]:
        """micro_step(model, part) for every part, group g on thread g with model g; results in part order.

        Afterwards the model holds the gradient of every part (see gather); the first error of any thread is raised
        once all threads have stopped.
        """
        models = self.models(len(groups))
        if self._pool is None or self._pool_size < len(groups):  # more threads than before: a larger pool
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(len(groups), thread_name_prefix="raytrm-micro", initializer=_one_thread)
            self._pool_size = len(groups)
        futures = [self._pool.submit(_run_group, micro_step, m, g) for m, g in zip(models, groups, strict=True)]
        errors = [f.exception() for f in futures]
        self.gather(models[1:])
        for error in errors:
            if error is not None:
                raise error
        return [result for f in futures for result in f.result()]

    def run_rounds(self, rounds: list[list[list[slice]]], micro_step: Callable[[nn.Module, slice], T]) -> list[T]:
        """Each round's groups as `run` runs them, one round after another (a round of one group runs on this thread,
        with all of torch's threads); results in order."""
        results: list[T] = []
        for groups in rounds:
            alone = [micro_step(self.model, part) for part in groups[0]] if len(groups) == 1 else None
            results += alone if alone is not None else self.run(groups, micro_step)
        return results

    def gather(self, replicas: list[nn.Module]) -> None:
        """Add the replicas' gradients to the model's, in order, and hand their sparse rows over; theirs are reset."""
        for replica in replicas:
            with torch.no_grad():
                for p, r in zip(self.model.parameters(), replica.parameters(), strict=True):
                    if r.grad is None:
                        continue
                    if p.grad is None:
                        p.grad = r.grad
                    else:
                        p.grad.add_(r.grad)
                    r.grad = None
            for mine, theirs in zip(self.model.modules(), replica.modules(), strict=True):
                if isinstance(mine, SparseEmbedding):
                    mine.adopt_pending(theirs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._pool_size = None, 0
        self._replicas = []


def _one_thread() -> None:
    torch.set_num_threads(1)


def _run_group(micro_step: Callable[[nn.Module, slice], T], model: nn.Module, parts: list[slice]) -> list[T]:
    return [micro_step(model, part) for part in parts]
