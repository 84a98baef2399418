"""Where a CPU training step's time goes: matrix products by shape, attention, and the rest.

`python -m benchmarks trm --breakdown` profiles one step of each timed row (raytrm's and the reference's) with torch's
profiler and splits its self time three ways. The products' rates, shape by shape, beside the matmul ceiling say
whether the products themselves could run faster; the products' share of raytrm's step, beside the reference's whole
step, bounds the ratio that any fusing of the rest could reach (`bound`: raytrm / reference were raytrm's time outside
its products zero).

CPU only: there each op's self time is the time its thread spent in it. On a GPU, time belongs to kernels that ops
launch asynchronously, and a compiled step's kernels are inductor's; the README's GPU analysis used traces.

raytrm's CPU step runs its micro-batches side by side, one per thread (raytrm.train.side_by_side), so the profiler
watches every thread: the worker threads' self times, each thread on its own core, are divided by their number to
give seconds of the step, and their products' rates are the threads' together, as the ceiling is. Where torch's
profiler cannot watch other threads, the step runs its micro-batches one after another, as under any profiler.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from raytrm.errors import UserError

#: The ops that are matrix products, and where their operands are among the op's inputs.
PRODUCT_OPERANDS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::addmm": (1, 2), "aten::baddbmm": (1, 2)}
#: oneDNN's linear (raytrm.fastpaths.onednn): x [..., k] @ weight [n, k].T, the weight second.
LINEAR = "mkldnn::_linear_pointwise"
PRODUCTS = {*PRODUCT_OPERANDS, LINEAR}
#: How many of the rest a breakdown names.
NAMED_OTHERS = 6


@dataclass
class Product:
    """Every call of one matrix-product shape in a step: [batch x] [m, k] @ [k, n]."""

    m: int
    k: int
    n: int
    batch: int
    calls: int
    seconds: float
    #: Run by oneDNN's linear (raytrm.fastpaths.onednn), not torch.mm's BLAS.
    onednn: bool = False

    @property
    def gflops(self) -> float:
        return 2 * self.batch * self.m * self.k * self.n * self.calls / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class Breakdown:
    """One profiled step of one row: self seconds of its products, its attention and everything else."""

    variant: str
    hidden: int
    impl: str
    step_seconds: float  # the row's median step, unprofiled
    matmul_gflops: float  # the row's measured ceiling
    onednn_gflops: float | None = None  # oneDNN's, where raytrm's linear layers run on it
    profiled_seconds: float = 0.0
    #: Threads that ran the step's products side by side (1: one after another, each product on torch's threads).
    product_threads: int = 1
    products_seconds: float = 0.0
    attention_seconds: float = 0.0
    others: list[tuple[str, float]] = field(default_factory=list)  # the largest of the rest, by name
    products: list[Product] = field(default_factory=list)  # by shape, the slowest first
    #: On a raytrm row beside the reference: raytrm / reference were raytrm's time outside its products zero.
    bound: float | None = None

    @property
    def products_share(self) -> float:
        return self.products_seconds / self.profiled_seconds if self.profiled_seconds else 0.0


def _operands(key: str, shapes: list[list[int]]) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of a product op from its recorded input shapes."""
    if key == LINEAR:
        x, weight = shapes[0], shapes[1]
        return 1, math.prod(x[:-1]), x[-1], weight[0]
    a, b = (shapes[i] for i in PRODUCT_OPERANDS[key])
    return (a[0] if len(a) == 3 else 1), a[-2], a[-1], b[-1]


def _watching_all_threads() -> dict:
    """profile()'s arguments for a profiler that records every thread's operations, where this torch has one."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


def profile_step(step: Callable[[], object], into: Breakdown) -> Breakdown:
    """Profile one call of a warm step and fill `into` with where its time went."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, **_watching_all_threads()) as prof:
        step()
    events = [e for e in prof.events() if e.self_cpu_time_total > 0]
    workers = {e.thread for e in events if e.key in PRODUCTS}
    # Threads running products side by side share the step's time; the calling thread's own operations (the
    # optimizer's, on all of torch's threads) count as they are.
    into.product_threads = max(1, len(workers))
    share = 1 / into.product_threads
    products: defaultdict[tuple[int, int, int, int, bool], list[float]] = defaultdict(lambda: [0, 0.0])
    rest: Counter[str] = Counter()
    for event in events:
        seconds = event.self_cpu_time_total / 1e6 * (share if event.thread in workers else 1.0)
        into.profiled_seconds += seconds
        if event.key in PRODUCTS:
            into.products_seconds += seconds
            shape = products[(*_operands(event.key, event.input_shapes), event.key == LINEAR)]
            shape[0] += 1
            shape[1] += seconds
        elif "scaled_dot_product" in event.key or "attention" in event.key:
            into.attention_seconds += seconds
        else:
            rest[event.key] += seconds
    into.products = [Product(m, k, n, batch, int(c), t, lib) for (batch, m, k, n, lib), (c, t) in products.items()]
    into.others = rest.most_common(NAMED_OTHERS)
    into.products.sort(key=lambda p: -p.seconds)
    return into


def format_breakdowns(rows: list[Breakdown], shapes: int = 8) -> str:
    lines = []
    for r in rows:
        total = r.profiled_seconds or 1.0
        lines.append(
            f"{r.variant} hidden {r.hidden}, {r.impl}: {r.step_seconds:.3f} s a step, {r.profiled_seconds:.3f} s "
            f"profiled; matmul ceiling {r.matmul_gflops:.1f} GFLOP/s"
            + (f", oneDNN's {r.onednn_gflops:.1f}" if r.onednn_gflops else "")
            + (f"; micro-batches side by side on {r.product_threads} threads" if r.product_threads > 1 else "")
        )
        lines.append(f"  products  {r.products_seconds:8.3f} s {100 * r.products_seconds / total:5.1f}%")
        lines.append(f"  attention {r.attention_seconds:8.3f} s {100 * r.attention_seconds / total:5.1f}%")
        other = total - r.products_seconds - r.attention_seconds
        named = ", ".join(f"{name} {seconds:.3f}" for name, seconds in r.others)
        lines.append(f"  other     {other:8.3f} s {100 * other / total:5.1f}%  ({named})")
        for p in r.products[:shapes]:
            shape = f"{p.batch} x " if p.batch > 1 else ""
            shape += f"[{p.m}, {p.k}] @ [{p.k}, {p.n}]"
            ceiling, which = (r.onednn_gflops, "oneDNN's") if p.onednn and r.onednn_gflops else (r.matmul_gflops, "the")
            lines.append(
                f"    {shape:<32} {p.calls:>4} calls {p.seconds:7.3f} s {p.gflops:7.1f} GFLOP/s "
                f"({p.gflops / ceiling:.2f} of {which} ceiling)"
            )
        if r.bound is not None:
            lines.append(f"  raytrm / reference were raytrm's time outside its products zero: {r.bound:.2f}")
    return "\n".join(lines)


def as_json(rows: list[Breakdown]) -> list[dict]:
    return [{**asdict(r), "products_share": r.products_share} for r in rows]


def bound(raytrm: Breakdown, reference: Breakdown) -> float:
    """raytrm / reference in samples/s were raytrm's step its products alone (their share of the profiled step,
    applied to the unprofiled median)."""
    return reference.step_seconds / (raytrm.step_seconds * raytrm.products_share)


def cpu_only(device: torch.device) -> None:
    """Refuse a breakdown off the CPU, before anything is timed."""
    if device.type != "cpu":
        raise UserError(f"--breakdown profiles CPU steps only, not {device.type}; fix: drop --breakdown or --device")
