"""Half-precision matrix products on NVIDIA GPUs with the cuBLASLt algorithm measured fastest for each shape.

torch.mm asks cuBLAS, which runs the first algorithm of its heuristic; at TRM's shapes that is often not the fastest
of those cuBLASLt's heuristic offers. So, as PyTorch's TunableOp does for ROCm's libraries, the first call of each
shape times the heuristic's algorithms and torch.mm on the call's own operands, and that shape keeps the fastest for
the rest of the process, and for later processes on the same GPU, driver and cuBLASLt (raytrm.fastpaths.tuned).
Only an algorithm whose result equals torch.mm's to the bit on that call may win, and a kept choice is checked the
same way on its first call, so the choice changes how fast a product runs, never what it gives: algorithms that sum
in another order (split-K ones) show it at once on tens of millions of outputs. The choices timed are logged, one
line a shape.

It serves the operation linear (raytrm's Linear layers, forward and both gradients) through the operator
torch.ops.raytrm.mm (`mm` is its differentiable form), which torch.compile keeps as it is where it would call cuBLAS
itself. cuBLASLt is the copy torch loaded, called through ctypes; where there is none (CPU builds of torch), or off
CUDA, or in other dtypes, products are torch.mm's. Outputs of a width that is no multiple of 8 (TRM's heads: the
vocabulary's 11, halting's 2) come from zero rows padded to one, on cuBLASLt or on torch's product: cuBLAS's kernels
for unaligned widths are several times slower.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raytrm.fastpaths.registry import Backend
from raytrm.fastpaths.tuned import TunedChoices, store_path
from raytrm.hardware import device as devices

logger = logging.getLogger(__name__)

#: Tests and A/B runs turn this off: products then run torch.mm, through the same operator.
ENABLED = True

#: How many algorithms to ask cuBLASLt's heuristic for (it offers fewer at TRM's shapes).
CANDIDATES = 16
#: The workspace an algorithm may use, one a device (_workspace).
WORKSPACE_BYTES = 32 * 1024 * 1024
#: Timing a candidate: untimed calls, then the median over ROUNDS of REPEATS calls each.
WARMUP, ROUNDS, REPEATS = 2, 5, 3

# cuBLASLt's enums (cublasLt.h, library_types.h).
_OP_N, _OP_T = 0, 1
_DTYPES = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
_R_32F, _COMPUTE_32F = 0, 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE, _PREF_ALIGNMENT = 1, (5, 6, 7, 8)  # ..._MIN_ALIGNMENT_{A,B,C,D}_BYTES
_MAX_ALIGNMENT = 256


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _library_path() -> str | None:
    """The libcublasLt torch loaded (it comes with libtorch_cuda), else one in the nvidia wheels beside torch."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    try:
        import nvidia  # the CUDA wheels torch depends on
    except ImportError:
        return None
    for base in nvidia.__path__:
        for path in sorted(glob.glob(os.path.join(base, "*", "lib", "libcublasLt.so*"))):
            return path
    return None


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """cuBLASLt with the signatures used here, and why not (None where it loaded)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    path = _library_path()
    if path is None:
        return None, "torch loaded no cuBLASLt"
    lib = ctypes.CDLL(path)
    p, i, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    for name, args in (
        ("cublasLtCreate", [ctypes.POINTER(p)]),
        ("cublasLtMatmulDescCreate", [ctypes.POINTER(p), i, i]),
        ("cublasLtMatmulDescSetAttribute", [p, i, p, size]),
        ("cublasLtMatrixLayoutCreate", [ctypes.POINTER(p), i, u64, u64, i64]),
        ("cublasLtMatmulPreferenceCreate", [ctypes.POINTER(p)]),
        ("cublasLtMatmulPreferenceSetAttribute", [p, i, p, size]),
        ("cublasLtMatmulAlgoGetHeuristic", [p, p, p, p, p, p, p, i, ctypes.POINTER(_Heuristic), ctypes.POINTER(i)]),
        ("cublasLtMatmul", [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, size, p]),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib, None


_lib: ctypes.CDLL | None = None
_why_not: str | None = None
_loaded = False


def load() -> bool:
    """Load cuBLASLt, once a process; True where it loaded. Called when a model is built, so that under torch.compile
    the conditions read a settled module state."""
    global _lib, _why_not, _loaded
    if not _loaded:
        _lib, _why_not = _load()
        _loaded = True
        if _lib is None:
            logger.debug("Half-precision products run on torch.mm: %s", _why_not)
    return _lib is not None


def _library() -> ctypes.CDLL:
    load()
    assert _lib is not None, "cuBLASLt is not loaded"
    return _lib


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt's {call} failed with status {status}")


def operand(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """How cuBLASLt, column-major, sees the 2-D row-major view t [r, c] as the transpose it needs, t^T [c, r]:
    (op, rows, cols, leading dimension) of the matrix in memory, or None where t is neither row- nor column-major.

    Row-major t is column-major t^T, taken as it is; column-major t (a transposed view) is taken transposed.
    """
    r, c = t.shape
    if t.stride(1) == 1 and (r == 1 or t.stride(0) >= c):
        return _OP_N, c, r, max(t.stride(0), c)
    if t.stride(0) == 1 and (c == 1 or t.stride(1) >= r):
        return _OP_T, r, c, max(t.stride(1), r)
    return None


def _alignment(*tensors: torch.Tensor) -> int:
    """The largest power of two, at most 256, that divides every tensor's address."""
    address = 0
    for t in tensors:
        address |= t.data_ptr()
    return min(_MAX_ALIGNMENT, address & -address) if address else _MAX_ALIGNMENT


@dataclass
class _Plan:
    """One shape's product: its descriptors and the algorithm that won, or None where torch.mm did (or serves the
    shape alone: other dtypes or devices, strided operands)."""

    desc: ctypes.c_void_p | None = None
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] | None = None  # b's, a's, out's
    algo: _Algo | None = None
    handle: ctypes.c_void_p | None = None  # the device's cuBLASLt handle
    workspace: int = 0  # the device's workspace's address


_handles: dict[int, ctypes.c_void_p] = {}
_workspaces: dict[int, torch.Tensor] = {}
_plans: dict[tuple, _Plan] = {}
_kept: dict[int, TunedChoices] = {}
_ALPHA, _BETA = ctypes.c_float(1.0), ctypes.c_float(0.0)
_ALPHA_REF, _BETA_REF = ctypes.byref(_ALPHA), ctypes.byref(_BETA)


def _raw_stream(device: int) -> int:
    """The current stream's handle (torch's private accessor, as inductor's generated code uses it: several times
    faster than torch.cuda.current_stream)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _handle(device: int) -> ctypes.c_void_p:
    if device not in _handles:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _handles[device] = handle
    return _handles[device]


def _workspace(device: int) -> torch.Tensor:
    """The device's workspace, kept for the process (`prepare` makes it before any CUDA graph). Products run on one
    stream at a time in raytrm, so one workspace a device serves them all; it is never freed, so the stream it is
    made on does not matter."""
    if device not in _workspaces:
        _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
    return _workspaces[device]


def prepare(device: torch.device) -> None:
    """Make the device's handle and workspace now, not on its first product.

    Under torch.compile's CUDA graphs that first product runs in a graph's warm-up, whose allocations come from the
    graphs' private pool even on a stream of their own: the workspace made there outlives the graph untracked, and
    torch refuses the graphs ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"): the round falls
    back to eager, and the same error in a backward's warm-up ends the step. raytrm.train.compile calls this before
    it compiles a region with graphs."""
    if device.type == devices.CUDA and load():
        index = torch.cuda.current_device() if device.index is None else device.index
        _handle(index)
        _workspace(index)


def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    layout = ctypes.c_void_p()
    _check(_library().cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "layout")
    return layout


def _candidates(a: torch.Tensor, b: torch.Tensor, alignment: int) -> tuple[ctypes.c_void_p, tuple, list[_Heuristic]]:
    """The descriptors of out = a @ b as cuBLASLt's out^T = b^T a^T, and its heuristic's algorithms."""
    lib = _library()
    dtype = _DTYPES[a.dtype]
    (op_b, *b_shape), (op_a, *a_shape) = operand(b), operand(a)
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "descriptor")
    for attribute, op in ((_DESC_TRANSA, op_b), (_DESC_TRANSB, op_a)):
        value = ctypes.c_int(op)
        _check(lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), 4), "transpose")
    M, N = a.shape[0], b.shape[1]
    layouts = (_layout(dtype, *b_shape), _layout(dtype, *a_shape), _layout(dtype, N, M, N))
    preference = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "preference")
    settings = [(_PREF_MAX_WORKSPACE, ctypes.c_uint64(WORKSPACE_BYTES))]
    settings += [(attribute, ctypes.c_uint32(alignment)) for attribute in _PREF_ALIGNMENT]
    for attribute, setting in settings:
        status = lib.cublasLtMatmulPreferenceSetAttribute(
            preference, attribute, ctypes.byref(setting), ctypes.sizeof(setting)
        )
        _check(status, "preference")
    results = (_Heuristic * CANDIDATES)()
    count = ctypes.c_int()
    status = lib.cublasLtMatmulAlgoGetHeuristic(
        _handle(a.device.index), desc, layouts[0], layouts[1], layouts[2], layouts[2], preference, CANDIDATES, results,
        ctypes.byref(count),
    )  # fmt: skip
    found = [results[i] for i in range(count.value)] if status == 0 else []
    return desc, layouts, [h for h in found if h.state == 0 and h.workspace_size <= WORKSPACE_BYTES]


def _run(plan: _Plan, algo: _Algo, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b with algo, on the current stream."""
    b_layout, a_layout, out_layout = plan.layouts
    status = _lib.cublasLtMatmul(
        plan.handle, plan.desc, _ALPHA_REF, b.data_ptr(), b_layout, a.data_ptr(), a_layout, _BETA_REF, out.data_ptr(),
        out_layout, out.data_ptr(), out_layout, algo, plan.workspace, WORKSPACE_BYTES, _raw_stream(a.device.index),
    )  # fmt: skip
    _check(status, "cublasLtMatmul")


def _time(fn) -> float:
    """Median seconds a call of fn over ROUNDS rounds of REPEATS calls (after WARMUP), by CUDA events."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPEATS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / REPEATS)
    return statistics.median(times)


def _tune(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alignment: int) -> _Plan:
    """Time torch.mm and the heuristic's algorithms that give torch.mm's bits on a and b; the fastest wins."""
    desc, layouts, found = _candidates(a, b, alignment)
    device = a.device.index
    plan = _Plan(desc, layouts, None, _handle(device), _workspace(device).data_ptr())
    expected = torch.mm(a, b)
    best = base = _time(lambda: torch.mm(a, b, out=out))
    chosen = None
    for index, heuristic in enumerate(found):
        try:
            _run(plan, heuristic.algo, a, b, out)
        except RuntimeError:
            continue
        if not torch.equal(out, expected):
            continue
        seconds = _time(lambda h=heuristic: _run(plan, h.algo, a, b, out))
        if seconds < best:
            best, chosen, plan.algo = seconds, index, _Algo.from_buffer_copy(heuristic.algo)
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    shape = f"[{M} x {K}] @ [{K} x {N}] ({str(a.dtype).removeprefix('torch.')})"
    if chosen is None:
        logger.info(
            "Products %s: torch.mm, %.0f us (no faster one of %d cuBLASLt offered)", shape, base * 1e6, len(found)
        )
    else:
        logger.info(
            "Products %s: cuBLASLt's algorithm %d of %d, %.0f us against torch.mm's %.0f", shape, chosen, len(found),
            best * 1e6, base * 1e6,
        )  # fmt: skip
    return plan


def available(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a @ b may run on cuBLASLt: 2-D CUDA tensors of one half dtype, each row- or column-major."""
    return (
        a.device.type == devices.CUDA
        and a.dim() == b.dim() == 2
        and a.dtype == b.dtype
        and a.dtype in _DTYPES
        and a.shape[0] * a.shape[1] * b.shape[1] > 0
        and operand(a) is not None
        and operand(b) is not None
        and load()
    )


def _choices(device: int) -> TunedChoices:
    """The choices kept for this GPU, driver and cuBLASLt: another of either may rank the algorithms otherwise."""
    if device not in _kept:
        lib = _library()
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        name = torch.cuda.get_device_name(device)
        _kept[device] = TunedChoices(
            store_path("cublaslt", name, f"driver{_driver_version()}", f"cublaslt{lib.cublasLtGetVersion()}")
        )
    return _kept[device]


def _driver_version() -> str:
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return str(version.value)
    except (OSError, AttributeError):
        return "unknown"


def _choice_key(a: torch.Tensor, b: torch.Tensor, alignment: int) -> str:
    return f"{tuple(a.shape)}{a.stride()}@{tuple(b.shape)}{b.stride()} {a.dtype} aligned {alignment}"


def _kept_plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alignment: int, algo: list | None) -> _Plan | None:
    """The plan of a choice an earlier process made for this shape, if it still gives torch.mm's bits here."""
    desc, layouts, _ = _candidates(a, b, alignment)
    device = a.device.index
    plan = _Plan(desc, layouts, None, _handle(device), _workspace(device).data_ptr())
    if algo is None:
        return plan
    plan.algo = _Algo()
    plan.algo.data[:] = algo
    try:
        _run(plan, plan.algo, a, b, out)
    except RuntimeError:
        return None
    return plan if torch.equal(out, torch.mm(a, b)) else None


def _plan(a: torch.Tensor, b: torch.Tensor) -> _Plan | None:
    """The plan for a @ b's shape, layouts, dtype and alignment: kept from an earlier process on this GPU, or timed
    now if this is its first call (None inside a CUDA graph's capture, where nothing can be timed or checked: torch.mm
    serves that call)."""
    if not available(a, b):
        return _Plan()
    out = a.new_empty(a.shape[0], b.shape[1])
    if torch.cuda.is_current_stream_capturing():
        return None
    alignment = _alignment(a, b, out)
    choices, key = _choices(a.device.index), _choice_key(a, b, alignment)
    found, algo = choices.get(key)
    plan = _kept_plan(a, b, out, alignment, algo) if found else None
    if plan is not None:
        logger.debug("Products %s: %s, as measured by an earlier run", key, "cuBLASLt" if algo else "torch.mm")
        return plan
    plan = _tune(a, b, out, alignment)
    choices.put(key, list(plan.algo.data) if plan.algo is not None else None)
    return plan


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, as torch.mm gives it, with the fastest algorithm for its shape (module docstring).

    Called for every product of a step, so the usual call is a dictionary lookup and the library call: a fresh
    output is always aligned to 256 bytes (torch's allocator), so the operands' addresses' low bits stand for the
    alignment the plan was timed at.
    """
    if not ENABLED:
        return torch.mm(a, b)
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, (a.data_ptr() | b.data_ptr()) & 255)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(a, b)
        if plan is None:
            return torch.mm(a, b)
        _plans[key] = plan
    if plan.algo is None:
        return torch.mm(a, b)
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    _run(plan, plan.algo, a, b, out)
    return out


# The operator: a plain dispatcher operator (torch.library.custom_op's wrapping costs twice the host time a call, and
# a step runs some 170 products), with its gradients from _Product below.
_OPERATORS = torch.library.Library("raytrm", "FRAGMENT")
_OPERATORS.define("mm(Tensor a, Tensor b) -> Tensor")
_OPERATORS.impl("mm", product, "CompositeExplicitAutograd")


@torch.library.register_fake("raytrm::mm")
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


class _Product(torch.autograd.Function):
    """a @ b on torch.ops.raytrm.mm, forward and for both gradients."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return torch.ops.raytrm.mm(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        grad_a = torch.ops.raytrm.mm(grad, b.t()) if ctx.needs_input_grad[0] else None
        grad_b = torch.ops.raytrm.mm(a.t(), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D a and b, differentiable (`product` forward and backward)."""
    return _Product.apply(a, b)


def _mm_flops(a_shape: torch.Size, b_shape: torch.Size, *args: object, **kwargs: object) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(torch.ops.raytrm.mm)(_mm_flops)


_register_flops()


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a Linear's x @ weight.T goes through the operator: on CUDA in half precision, where cuBLASLt loaded,
    with both of the weight's sides multiples of 8 (rows of 16 bytes).

    Other widths are left to torch.mm: under torch.compile inductor pads them to such multiples, which the operator,
    opaque to it, would forgo (TRM-MLP's position mixing, 97 positions, ran slower through it, on CUTLASS's unaligned
    kernels).
    """
    out_features, in_features = weight.shape
    return (
        ENABLED
        and _lib is not None
        and x.device.type == devices.CUDA
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and in_features % 8 == 0
        and out_features % 8 == 0
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias: F.linear adds one inside cuBLAS's product, rounding once) with its products,
    forward and backward, on torch.ops.raytrm.mm."""
    return mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])


def _padded(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """weight (and bias) with zero rows up to a multiple of 8 outputs, and the outputs it had."""
    out_features = weight.shape[0]
    padding = -out_features % 8
    if not padding:
        return weight, bias, out_features
    return F.pad(weight, (0, 0, 0, padding)), None if bias is None else F.pad(bias, (0, padding)), out_features


def _half_on_cuda_why_not(x: torch.Tensor) -> str | None:
    if x.device.type != devices.CUDA:
        return "not on a CUDA GPU"
    return None if x.dtype in _DTYPES else "not half precision"


def linear_why_not(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """The operation linear's, on cuBLASLt: serves' conditions, the output width padded to a multiple of 8; no bias
    (F.linear adds one inside cuBLAS's product)."""
    if why := _half_on_cuda_why_not(x):
        return why
    if bias is not None:
        return "a bias"
    if not ENABLED:
        return "turned off (cublaslt.ENABLED)"
    if _lib is None:
        return _why_not or "not loaded (fastpaths.prepare() loads it)"
    if weight.dtype != x.dtype:
        return "the weight is in another dtype"
    if weight.shape[1] % 8:
        return "the input width is no multiple of 8 (inductor pads those itself)"
    return None


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The operation linear on cuBLASLt, the output width padded to a multiple of 8 and cut back."""
    weight, _, out_features = _padded(weight, None)
    y = linear(x, weight)
    return y if weight.shape[0] == out_features else y[..., :out_features]


def torch_padded_why_not(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """The operation linear's, on torch's product with the output width padded: half precision on CUDA, an output
    width that is no multiple of 8."""
    if why := _half_on_cuda_why_not(x):
        return why
    return None if weight.shape[0] % 8 else "the output width is a multiple of 8"


def torch_padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the output width padded to a multiple of 8 and cut back."""
    weight, bias, out_features = _padded(weight, bias)
    return F.linear(x, weight, bias)[..., :out_features]


BACKENDS = (
    Backend("linear", "cublaslt", linear_why_not, padded_linear),
    Backend("linear", "torch-padded", torch_padded_why_not, torch_padded_linear),
)
