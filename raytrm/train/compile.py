"""torch.compile of the model's repeated region, chosen per device, with a fallback to eager that says why.

TRM applies one small network H_cycles x (L_cycles + 1) times per supervision step, so a step is hundreds of small
kernel launches of the same few shapes. Compiling the round (L_cycles latent updates and one answer update) once
fuses its norms, SwiGLU and residual adds and is reused by every round of every step: the no-grad rounds and the
back-propagated last one are two graphs of the same region. The transformer compiles its whole forward.

The plan (`plan_compile`) depends on the device and the torch build, and is logged once:
- cuda: inductor, with CUDA graphs (mode reduce-overhead) over the regions a model names in `graph_regions` (TRM:
  its round, run several times a step, not the step's edges, run once; the transformer: its forward). A round's
  hundreds of launches then cost the host one replay, which matters where the host, not the GPU, is the limit
  (small batches). `on` compiles without graphs;
  `cudagraphs` asks for them over a model's named regions, or over every compiled region of a model that names
  none.
- mps: inductor where torch has its Metal backend (torch >= 2.8), eager otherwise; never CUDA graphs (asking for
  them on MPS compiles without them, and says so).
- cpu: inductor needs a C++ compiler; `auto` stays eager on a CPU (docs/performance.md's compiled-on-a-CPU row is
  why), `on` compiles where a compiler is found.
A region whose compilation fails on first use runs eagerly from then on, with one warning naming the error.
Compiled artifacts persist under raytrm's cache dir (`use_compile_caches`), so a second identical run, or the next
tuning trial of the same model, loads them instead of compiling again.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrm.constants import compile_cache_env

logger = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", "on", "off", "cudagraphs")
#: The first torch whose inductor generates Metal kernels for MPS.
MPS_INDUCTOR_TORCH = (2, 8)


@dataclass(frozen=True)
class CompilePlan:
    """What to compile with: backend None means eager; mode "reduce-overhead" adds CUDA graphs, over only the
    regions a model names in `graph_regions` where named_graphs_only (else over every region of a model that names
    none)."""

    backend: str | None
    mode: str | None
    reason: str
    named_graphs_only: bool = False

    @property
    def enabled(self) -> bool:
        return self.backend is not None


def _version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def has_cxx() -> bool:
    """Whether a C++ compiler is on PATH (inductor's CPU backend builds its kernels with one)."""
    return any(shutil.which(name) for name in ("c++", "g++", "clang++"))


def plan_compile(
    requested: str, device_type: str, torch_version: str | None = None, cxx: Callable[[], bool] = has_cxx
) -> CompilePlan:
    """The compile plan for a device (see the module docstring); torch_version defaults to the running torch."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if requested == "off":
        return CompilePlan(None, None, "compile off, as configured")
    if device_type == "cuda":
        if requested == "cudagraphs":
            return CompilePlan("inductor", "reduce-overhead", "cuda: inductor with CUDA graphs")
        if requested == "auto":
            why = "cuda: inductor, with CUDA graphs over the regions the model names for them"
            return CompilePlan("inductor", "reduce-overhead", why, named_graphs_only=True)
        return CompilePlan("inductor", None, "cuda: inductor")
    if device_type == "mps":
        if _version(torch_version) < MPS_INDUCTOR_TORCH:
            return CompilePlan(
                None, None, f"mps: torch {torch_version} has no inductor backend for MPS (2.8 or later has); eager"
            )
        why = " (CUDA graphs asked for: MPS has none)" if requested == "cudagraphs" else ""
        return CompilePlan("inductor", None, f"mps: inductor's Metal backend{why}")
    if requested == "auto":
        return CompilePlan(None, None, "cpu: eager (compile: on to compile)")
    if not cxx():
        return CompilePlan(None, None, "cpu: no C++ compiler on PATH for inductor; eager")
    why = " (CUDA graphs asked for: a CPU has none)" if requested == "cudagraphs" else ""
    return CompilePlan("inductor", None, f"cpu: inductor{why}")


class Compiled:
    """A function run through its compiled form; if compiling or running that fails (not for lack of memory), the
    eager function runs instead from then on, and one warning says why.

    clone_outputs: under CUDA graphs a replay writes its outputs into the same memory as the replay before, so a
    graphed region's outputs (the transformer's forward's) are copied out of the graphs' memory, unless
    in_graph_memory: the region hands them on in the graphs' memory instead (a model's `graph_outputs_in_place`,
    TRM's round): CUDA graph trees record each call of a step as a graph of its own, which reads the call before's
    outputs where they were written; the model copies out what outlives the step.

    batch_dims: the dimension of each positional argument that holds the micro-batch (None: none), marked dynamic
    at every call. The first call then traces the graph every micro-batch size runs, so a run that starts at its
    final size (the memory governor's kept fit) compiles what a run that walked up to it did, and finds it in the
    compile caches; left to dynamo, the batch turns dynamic only at the second size seen, and a run that never sees
    a second one compiles a static graph under another key.
    """

    def __init__(
        self,
        eager: Callable[..., Any],
        compiled: Callable[..., Any],
        what: str,
        clone_outputs: bool = False,
        in_graph_memory: bool = False,
        batch_dims: tuple[int | None, ...] = (),
    ) -> None:
        self.eager, self.compiled, self.what, self.clone_outputs = eager, compiled, what, clone_outputs
        self.in_graph_memory, self.batch_dims = in_graph_memory, batch_dims
        self.failed: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is None:
            try:
                if self.batch_dims:
                    _mark_batch(args, self.batch_dims)
                out = self.compiled(*args, **kwargs)
                return _cloned(out) if self.clone_outputs else out
            except Exception as error:
                from raytrm.train.memory.oom import is_out_of_memory

                if is_out_of_memory(error):
                    raise
                self.failed = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
                logger.warning("torch.compile of %s failed (%s); it runs eagerly from now on", self.what, self.failed)
        return self.eager(*args, **kwargs)


def use_compile_caches() -> dict[str, str]:
    """Keep compiled artifacts where the next run on this machine finds them; returns the settings in force.

    inductor's FX graph cache and AOTAutograd's cache (on by default in torch, in a temporary directory) and Triton's
    kernels and autotuning picks go under raytrm's cache dir (raytrm.constants.compile_cache_env), unless the
    environment names other places. Call before the model is built: Triton reads its autotuning switch when a
    kernel is defined. AOTAutograd would refuse to cache a graph holding a custom autograd Function (the fast paths'
    products); dynamo traces such a Function's forward and backward into the graph, so the cache key holds them.
    """
    for name, value in compile_cache_env().items():
        os.environ.setdefault(name, value)
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):  # torch >= 2.7
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    return {name: os.environ[name] for name in compile_cache_env()}


def compile_regions(
    model: Any, plan: CompilePlan, compiler: Callable[..., Callable[..., Any]] | None = None
) -> list[str]:
    """Compile the model's repeated regions in place per the plan; returns their names (none when eager).

    A region is a method the model names in `compile_regions` (TRM: `_round`); the instance's attribute then
    shadows the method, so the model's code calls the compiled form unchanged. compiler defaults to torch.compile.
    Where the model names a region's `batch_dims`, its batch is dynamic from the first call (Compiled).
    CUDA graphs, where the plan has them, record the regions `graph_regions` picks; their outputs are copied out of
    the graphs' memory, but for the regions the model names in `graph_outputs_in_place` (Compiled).
    """
    logger.info("compile plan: %s", plan.reason)
    if not plan.enabled:
        return []
    if compiler is None:
        import torch

        compiler = torch.compile
    names = list(getattr(model, "compile_regions", ()))
    graphed = graph_regions(model, names, plan)
    if graphed:
        from raytrm.fastpaths import cublaslt

        for device in {p.device for p in model.parameters()}:
            cublaslt.prepare(device)  # its workspace, before a graph's warm-up would allocate it in the graphs' pool
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(_own_memory)
    in_place = getattr(model, "graph_outputs_in_place", ())
    batch_dims = getattr(model, "batch_dims", {})
    for name in names:
        eager = getattr(model, name)
        graphs = name in graphed
        kwargs = {"backend": plan.backend, **({"mode": plan.mode} if graphs else {})}
        what = f"{type(model).__name__}.{name}"
        kept = graphs and name in in_place
        compiled = compiler(eager, **kwargs)
        dims = batch_dims.get(name, ())
        region = Compiled(eager, compiled, what, graphs and not kept, in_graph_memory=kept, batch_dims=dims)
        setattr(model, name, region)
    if graphed:
        model.forward = _new_graph_step(model.forward)
    return names


def _mark_batch(args: tuple[Any, ...], dims: tuple[int | None, ...]) -> None:
    """Mark the batch dimension of a region's tensor arguments dynamic for dynamo (a hint: it stays static where
    the region's code fixes it, as for a size of 1)."""
    import torch

    for arg, dim in zip(args, dims, strict=False):
        if dim is not None and isinstance(arg, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(arg, dim)


def graph_regions(model: Any, names: list[str], plan: CompilePlan) -> list[str]:
    """The compiled regions that CUDA graphs record under the plan: those the model names in `graph_regions`, or,
    where it names none, every region, unless the plan takes named ones only."""
    if plan.mode != "reduce-overhead":
        return []
    named = getattr(model, "graph_regions", None)
    if named is None:
        return [] if plan.named_graphs_only else names
    return [name for name in names if name in named]


def _own_memory(grad: Any) -> Any:
    """A parameter's gradient copied out of CUDA graphs' memory before it is accumulated.

    A graphed region's backward returns each weight's gradient in the graphs' memory, and the gradient accumulator
    keeps that very tensor as the weight's .grad; the next micro-batch's replay then overwrites it before its own
    gradient is added (torch raises: "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
    run"). The copies are of the weights' size (TRM's 27 MB in fp32 at hidden 512), once a backward."""
    return grad.clone()


def _new_graph_step(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The model's forward, first telling CUDA graphs that a new step begins: the outputs of the last one are dead
    (the carry was copied out), so their memory may be written again."""

    def step(*args: Any, **kwargs: Any) -> Any:
        import torch

        torch.compiler.cudagraph_mark_step_begin()
        return forward(*args, **kwargs)

    step.__wrapped__ = forward  # type: ignore[attr-defined]  # the compiled forward stays reachable (its `failed`)
    return step


def _cloned(out: Any) -> Any:
    """A region's outputs with each tensor copied (tuples, lists and dicts of them as they come)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a named tuple takes its fields one by one
        return type(out)(*(_cloned(x) for x in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_cloned(x) for x in out)
    if isinstance(out, dict):
        return {k: _cloned(v) for k, v in out.items()}
    return out
