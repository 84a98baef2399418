"""The contract every fast path keeps: for each operation and each backend the registry holds for it, the backend runs
on inputs it serves (its why_not is None) and gives the operation's plain formula's output, and where it has one its
gradients, within the tolerance that backend's own tests use. The plain formula runs with every backend off.

Triton's backends run on a CUDA GPU where there is one, else in Triton's CPU interpreter (a subprocess: Triton reads
TRITON_INTERPRET when a kernel is defined); oneDNN's on an AMD x86-64 CPU; the CUDA C++ and cuBLASLt ones on a GPU.
A backend added without a case here fails test_every_backend_has_a_case.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

import raytrm.fastpaths as fastpaths
from raytrm.fastpaths import onednn, registry
from raytrm.fastpaths import triton as triton_paths
from raytrm.fastpaths.hopper import library
from raytrm.models import ops  # noqa: F401  (defines the operations' plain formulas)
from raytrm.models.layers import RotaryEmbedding, SwiGLU
from tests.unit.fastpaths.interpreter import interpretable, run_interpreted
from tests.unit.fastpaths.test_triton import assert_within_a_rounding, exact_mix

Args = list[object]


@dataclass(frozen=True)
class Case:
    """How a backend is checked: where it runs, its inputs, which of them take gradients, and how close it must be."""

    runs_on: str  # "cpu", "onednn", "triton", "cuda" or "hopper"
    inputs: Callable[[torch.device], list[Args]]  # argument sets the backend serves
    compare: str  # "bits", "close", "fp32", "step", "exact" or "mix" (see _compare)
    grads: tuple[int, ...] = ()  # the arguments whose gradients are compared (with a gradient recorded)
    no_grad: bool = True  # checked without a gradient too (with grads, with one first)
    step: tuple[float, float] = (1e-3, 0.05)  # "step": the share of elements a bf16 step off, interpreted / on CUDA
    grad_tolerance: tuple[dict, ...] = ()  # "close": assert_close's tolerances for each gradient (default: its own)


def _randn(*shape: int, device: torch.device, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=device)).to(dtype)


def _tables(head_dim: int, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = RotaryEmbedding(head_dim, positions, 10000.0).to(device)()
    return cos, sin


def _mixing(columns: int, dtype: torch.dtype, device: torch.device) -> Args:
    mlp = SwiGLU(97, 4.0).to(device)
    cols = _randn(97, columns, device=device, scale=3.0, dtype=dtype)
    return [cols, mlp.gate_up_proj.weight.detach().to(dtype), mlp.down_proj.weight.detach().to(dtype), 1e-5]


CASES: dict[tuple[str, str], Case] = {
    ("linear", "cublaslt"): Case(
        "cuda",
        lambda d: [[_randn(8, 97, 512, device=d), _randn(1536, 512, device=d, scale=512**-0.5)]],
        "bits",
        grads=(0, 1),
    ),
    ("linear", "torch-padded"): Case(
        "cuda",
        lambda d: [[_randn(3, 50, 512, device=d), _randn(2, 512, device=d), _randn(2, device=d)]],
        "close",
        grads=(0, 1, 2),
        grad_tolerance=({}, {"rtol": 1e-2, "atol": 1e-2}, {"rtol": 1e-2, "atol": 1e-2}),
    ),
    ("linear", "onednn"): Case(
        "onednn",
        lambda d: [[_randn(3, 11, 48, device=d, dtype=torch.float32), _randn(40, 48, device=d, dtype=torch.float32)]],
        "fp32",
        grads=(0, 1),
    ),
    ("swiglu_gate", "triton"): Case(
        "triton",
        lambda d: [[_randn(2 * 64, 300, device=d, scale=3.0), 0], [_randn(5, 7, 2 * 96, device=d, scale=3.0), -1]],
        "step",
        grads=(0,),
    ),
    ("swiglu_down", "triton"): Case(
        "triton",
        lambda d: [[_randn(37, 2 * 128, device=d, scale=2.0), _randn(64, 128, device=d, scale=128**-0.5)]],
        "step",
        grads=(0, 1),
        step=(0.02, 0.05),
    ),
    ("swiglu_add_norm", "triton"): Case(
        "triton",
        lambda d: [
            [
                _randn(37, 64, device=d),
                _randn(2 * 128, 64, device=d, scale=64**-0.5),
                _randn(64, 128, device=d, scale=128**-0.5),
                1e-5,
                _randn(37, 64, device=d),
            ]
        ],
        "step",
        step=(0.02, 0.05),
    ),
    ("rope_qkv", "triton"): Case(
        "triton",
        lambda d: [[_randn(2, 97, 3 * 8 * 64, device=d, scale=3.0), *_tables(64, 100, d), 8]],
        "step",
        grads=(0,),
        step=(1e-3, 0.01),
    ),
    ("rope_attention", "triton"): Case(
        "triton",
        lambda d: [[_randn(1, 97, 3 * 2 * 64, device=d, scale=2.0), *_tables(64, 100, d), 2, False]],
        "exact",
        grads=(0,),
    ),
    ("mix_positions_norm", "triton"): Case("triton", lambda d: [_mixing(300, torch.bfloat16, d)], "mix"),
    ("mix_positions_norm", "cpu-blocks"): Case(
        "cpu",
        lambda d: [_mixing(2500, torch.float32, d)],
        "close",
        grads=(0, 1, 2),
        # The weights' gradients add up block by block: fp32 sums of 2,500 columns in another order.
        grad_tolerance=({"rtol": 1e-4, "atol": 1e-4},) * 3,
    ),
    ("swiglu", "hopper"): Case(
        "hopper",
        lambda d: [
            [
                _randn(3, 97, 512, device=d),
                _randn(2 * 1536, 512, device=d, scale=512**-0.5),
                _randn(512, 1536, device=d, scale=1536**-0.5),
            ]
        ],
        "step",
        grads=(0, 1, 2),
    ),
    ("attention", "hopper"): Case(
        "hopper",
        lambda d: [
            [_randn(4, 97, 512, device=d), _randn(1536, 512, device=d, scale=512**-0.5), *_tables(64, 128, d), 8]
        ],
        "exact",
        grads=(0, 1),
    ),
    ("swiglu_down_backward", "hopper"): Case(
        "hopper",
        lambda d: [
            [
                _randn(1000, 512, device=d, scale=0.02),
                _randn(1000, 2 * 1536, device=d, scale=2.0),
                _randn(512, 1536, device=d, scale=1536**-0.5),
                _randn(1000, 1536, device=d),
            ]
        ],
        "bits",
    ),
}


def _why_skipped(runs_on: str) -> str | None:
    """What a case needs that this machine lacks, or None."""
    cuda = torch.cuda.is_available()
    if runs_on == "onednn" and not onednn.ENABLED:
        return "needs oneDNN's linear (an AMD x86-64 CPU)"
    if runs_on == "cuda" and not cuda:
        return "needs a CUDA GPU"
    if runs_on == "hopper" and not (cuda and torch.cuda.get_device_capability() == (9, 0) and library._nvcc()):
        return "needs a Hopper GPU (sm_90) and nvcc"
    if runs_on == "triton" and not triton_paths.HAVE_TRITON:
        return "needs Triton"
    return None


@contextlib.contextmanager
def _plain() -> Iterator[None]:
    """Every backend off: the plain formulas throughout."""
    enabled, registry.ENABLED = registry.ENABLED, False
    try:
        yield
    finally:
        registry.ENABLED = enabled


def _outputs(result: object) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, tuple | list) else (result,)


def _run(formula: Callable[..., object], args: Args, grads: tuple[int, ...], dtype: torch.dtype | None = None) -> list:
    """formula's outputs on args (floating tensors cast to dtype where given) and, where grads, the gradients of
    those arguments under fixed random output gradients: detached, in fp64."""
    inputs = [a.to(dtype) if dtype and isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    inputs = [a.detach().clone().requires_grad_() if i in grads else a for i, a in enumerate(inputs)]
    outputs = _outputs(formula(*inputs))
    results = [o.detach() for o in outputs]
    if grads:
        generator = torch.Generator(device=outputs[0].device).manual_seed(1)
        upstream = [torch.randn(o.shape, device=o.device, generator=generator).to(o.dtype) for o in outputs]
        torch.autograd.backward(outputs, upstream)
        results += [inputs[i].grad for i in grads]
    return results


def _bf16_step(ours: torch.Tensor, plain: torch.Tensor, share: float) -> None:
    off = (ours.float() - plain.float()).abs()
    assert (off <= plain.float().abs() * 2**-7 + 1e-30).all(), off.max()
    assert (off > 0).float().mean() < share, (off > 0).float().mean()


def _compare(case: Case, op: str, run: Callable[..., object], args: Args, grads: tuple[int, ...]) -> None:
    """Run the backend and the plain formula on args and hold them to the case's tolerance."""
    formula = registry.formula(op)
    ours = _run(run, args, grads)
    with _plain():
        plain = _run(formula, args, grads)
    assert [t.shape for t in ours] == [t.shape for t in plain] and [t.dtype for t in ours] == [t.dtype for t in plain]
    interpreted = ours[0].device.type != "cuda"
    if case.compare == "bits":
        for a, b in zip(ours, plain, strict=True):
            assert torch.equal(a, b)
    elif case.compare == "close":  # sums in another order
        tolerances = ({},) * (len(ours) - len(grads)) + (case.grad_tolerance if grads else ())
        for a, b, tolerance in zip(ours, plain, tolerances, strict=True):
            torch.testing.assert_close(a, b, **tolerance)
    elif case.compare == "fp32":  # as close to fp64 as MKL's fp32 products, up to the order of the sums
        with _plain():
            exact = _run(formula, args, grads, torch.float64)
        for a, b, want in zip(ours, plain, exact, strict=True):
            assert (a.double() - want).abs().max() <= 4 * (b.double() - want).abs().max() + 1e-6
    elif case.compare == "step":  # equal but for the odd element a bf16 step apart
        for a, b in zip(ours, plain, strict=True):
            _bf16_step(a, b, case.step[0] if interpreted else case.step[1])
    elif case.compare == "exact":  # as close to the fp64 result as the plain bf16 formula, on average and at worst
        with _plain():
            exact = _run(formula, args, grads, torch.float64)
        for a, b, truth in zip(ours, plain, exact, strict=True):
            a, b = (a.double() - truth).abs(), (b.double() - truth).abs()
            # At worst within one bf16 rounding of the largest value more: the two round at different points.
            rounding = 2**-8 * truth.abs().max()
            assert a.max() <= b.max() + rounding and a.mean() <= 1.05 * b.mean(), (a.max(), b.max(), a.mean(), b.mean())
    elif case.compare == "mix":  # within a rounding of the formula with exact products, rounded where it rounds
        assert_within_a_rounding(ours[0], exact_mix(*args))
    else:
        raise AssertionError(f"no comparison {case.compare}")


def check(op: str, name: str, device: str) -> None:
    """Hold operation op's backend `name` to its case, on device."""
    fastpaths.prepare()
    case = CASES[(op, name)]
    backend = next(b for b in registry.backends(op) if b.name == name)
    torch.manual_seed(0)
    for args in case.inputs(torch.device(device)):
        modes = ([True] if case.grads else []) + ([False] if case.no_grad or not case.grads else [])
        for grad in modes:
            with torch.set_grad_enabled(grad):
                why = backend.why_not(*args)
                assert why is None, f"{name} does not serve the case's inputs for {op}: {why}"
                _compare(case, op, backend.run, args, case.grads if grad else ())


def _interpreted_results() -> dict[str, str | None]:
    """Every Triton case run once, in one subprocess under Triton's interpreter: case -> None, or its failure."""
    names = [f"{op}:{name}" for (op, name), case in CASES.items() if case.runs_on == "triton"]
    output = run_interpreted(
        f"""
        import json, traceback
        from tests.unit.fastpaths.test_contract import check
        results = {{}}
        for case in {names!r}:
            try:
                check(*case.split(":"), "cpu")
                results[case] = None
            except BaseException:
                results[case] = traceback.format_exc()[-2000:]
        print("OK")
        print(json.dumps(results))
        """
    )
    return json.loads(output.splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> Iterator[Callable[[], dict[str, str | None]]]:
    results: dict[str, str | None] = {}

    def get() -> dict[str, str | None]:
        if not results:
            results.update(_interpreted_results())
        return results

    yield get


def test_every_backend_has_a_case():
    fastpaths.prepare()
    assert set(CASES) == {(b.op, b.name) for b in registry.backends()}


@pytest.mark.parametrize(
    ("op", "name"),
    [
        # Off CUDA a Triton case runs in Triton's CPU interpreter, seconds a kernel: in the full suite, not the loop.
        pytest.param(op, name, id=f"{op}-{name}", marks=[pytest.mark.slow] if case.runs_on == "triton" else [])
        for (op, name), case in CASES.items()
    ],
)
def test_a_backend_gives_its_operations_plain_formula(op, name, interpreted):
    case = CASES[(op, name)]
    if why := _why_skipped(case.runs_on):
        pytest.skip(why)
    if case.runs_on == "triton" and not torch.cuda.is_available():
        if interpretable.args[0]:  # the interpreter's needs (a skipif mark's condition)
            pytest.skip(interpretable.kwargs["reason"])
        failure = interpreted()[f"{op}:{name}"]
        assert failure is None, failure
        return
    device = "cpu" if case.runs_on in ("cpu", "onednn") else "cuda"
    check(op, name, device)
