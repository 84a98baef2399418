"""The compile plan per device (CUDA and MPS faked by name and torch version), the eager fallback, and a compiled
TRM round that trains to the same numbers as the eager one."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from raytrm.train.compile import CompilePlan, compile_regions, plan_compile
from raytrm.train.trainer import Trainer


def test_cuda_compiles_with_inductor_and_cuda_graphs_over_named_regions_unless_asked_for_none_or_all():
    auto = plan_compile("auto", "cuda", "2.13.0")
    assert (auto.backend, auto.mode, auto.named_graphs_only) == ("inductor", "reduce-overhead", True)
    assert "CUDA graphs over the regions the model names for them" in auto.reason
    assert plan_compile("on", "cuda", "2.13.0") == CompilePlan("inductor", None, "cuda: inductor")
    graphs = plan_compile("cudagraphs", "cuda", "2.13.0")
    assert graphs.mode == "reduce-overhead" and not graphs.named_graphs_only
    assert not plan_compile("off", "cuda", "2.13.0").enabled


def test_mps_compiles_only_where_torch_has_a_metal_backend_and_never_with_cuda_graphs():
    old = plan_compile("auto", "mps", "2.5.1")
    assert not old.enabled and "torch 2.5.1 has no inductor backend for MPS" in old.reason
    assert plan_compile("auto", "mps", "2.13.0+cpu") == CompilePlan("inductor", None, "mps: inductor's Metal backend")
    graphs = plan_compile("cudagraphs", "mps", "2.13.0")
    assert graphs.mode is None and "MPS has none" in graphs.reason


@pytest.mark.parametrize(
    ("torch_version", "asked", "compiled", "logged"),
    [
        ("2.5.1", "auto", False, "mps: torch 2.5.1 has no inductor backend for MPS (2.8 or later has); eager"),
        ("2.13.0", "auto", True, "mps: inductor's Metal backend"),
        ("2.13.0", "cudagraphs", True, "mps: inductor's Metal backend (CUDA graphs asked for: MPS has none)"),
    ],
)
def test_on_mps_the_regions_compile_per_the_plan_without_cuda_graphs_and_the_choice_is_logged(
    caplog, torch_version, asked, compiled, logged
):
    model, kwargs_seen = Doubler(), []

    def compiler(fn, **kwargs):
        kwargs_seen.append(kwargs)
        return fn

    forward = model.forward
    with caplog.at_level(logging.INFO, logger="raytrm.train.compile"):
        names = compile_regions(model, plan_compile(asked, "mps", torch_version), compiler=compiler)
    assert f"compile plan: {logged}" in caplog.text
    assert names == (["twice"] if compiled else [])
    assert kwargs_seen == ([{"backend": "inductor"}] if compiled else [])  # no mode: no CUDA graphs
    assert model.forward == forward  # no CUDA-graph step marks on MPS
    assert model.twice(torch.ones(2)).tolist() == [2.0, 2.0]


def test_a_cpu_stays_eager_unless_asked_and_needs_a_cxx_compiler():
    assert not plan_compile("auto", "cpu", "2.13.0", cxx=lambda: True).enabled
    assert plan_compile("on", "cpu", "2.13.0", cxx=lambda: True).backend == "inductor"
    missing = plan_compile("on", "cpu", "2.13.0", cxx=lambda: False)
    assert not missing.enabled and "no C++ compiler" in missing.reason


class Doubler(torch.nn.Module):
    compile_regions = ("twice",)

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class Repeater(Doubler):
    """A model whose repeated region (twice) is named for CUDA graphs and whose once-a-step one (thrice) is not."""

    compile_regions = ("twice", "thrice")
    graph_regions = ("twice",)

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def thrice(self, x: torch.Tensor) -> torch.Tensor:
        return 3 * x


class Relay(Repeater):
    """A Repeater whose graphed region hands its outputs on in the graphs' memory, as TRM's round does."""

    graph_outputs_in_place = ("twice",)


@pytest.mark.parametrize(
    ("model", "asked", "graphed"),
    [
        (Repeater, "auto", ["twice"]),
        (Relay, "auto", ["twice"]),
        (Relay, "on", []),  # no graphs, no graphs' memory
        (Repeater, "cudagraphs", ["twice"]),
        (Repeater, "on", []),
        (Doubler, "auto", []),  # names no region: auto leaves it without graphs
        (Doubler, "cudagraphs", ["twice"]),  # ... and cudagraphs records all of its regions
    ],
)
def test_cuda_graphs_record_the_regions_a_model_names_and_others_compile_without(monkeypatch, model, asked, graphed):
    from raytrm.fastpaths import cublaslt

    prepared, seen = [], {}
    monkeypatch.setattr(cublaslt, "prepare", prepared.append)

    def compiler(fn, **kwargs):
        seen[fn.__name__] = kwargs
        return fn

    model = model()
    forward = model.forward
    compile_regions(model, plan_compile(asked, "cuda", "2.13.0"), compiler=compiler)
    assert {name for name, kwargs in seen.items() if kwargs.get("mode") == "reduce-overhead"} == set(graphed)
    assert all(kwargs["backend"] == "inductor" for kwargs in seen.values())
    kept = set(getattr(model, "graph_outputs_in_place", ())) & set(graphed)
    for name in model.compile_regions:
        # A replay's outputs are copied out, but where the model hands them on in the graphs' memory.
        region = getattr(model, name)
        assert (region.clone_outputs, region.in_graph_memory) == (name in graphed and name not in kept, name in kept)
    # Graphs mark each step's start, and cuBLASLt's workspace is made before any graph's warm-up.
    assert (model.forward != forward) == bool(graphed)
    assert prepared == ([torch.device("cpu")] if graphed and list(model.parameters()) else [])
    for weight in model.parameters():
        # A gradient as a graphed backward returns it: under graphs the weight keeps a copy, not that memory.
        returned: list[int] = []

        class Backward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, w):
                return w * 1

            @staticmethod
            def backward(ctx, grad, returned=returned):
                out = grad * 3
                returned.append(out.data_ptr())
                return out

        Backward.apply(weight).sum().backward()
        assert weight.grad.tolist() == [3.0]
        assert (weight.grad.data_ptr() != returned[0]) == bool(graphed)


def test_on_cuda_auto_records_the_transformers_whole_forward_with_cuda_graphs(monkeypatch):
    from raytrm import config as cfg
    from raytrm.fastpaths import cublaslt
    from raytrm.models.transformer import Transformer

    monkeypatch.setattr(cublaslt, "prepare", lambda device: None)
    seen = {}

    def compiler(fn, **kwargs):
        seen[fn.__name__] = kwargs
        return fn

    config = {"name": "transformer", "hidden_size": 32, "num_heads": 2, "layers": 1, "seq_len": 8}
    model = Transformer(cfg.from_dict(cfg.ModelConfig, config, prefix="model"))
    inputs = torch.randint(0, 256, (2, 8))
    eager = model(inputs)
    assert compile_regions(model, plan_compile("auto", "cuda", "2.13.0"), compiler=compiler) == ["forward"]
    assert seen == {"forward": {"backend": "inductor", "mode": "reduce-overhead"}}
    region = model.forward.__wrapped__  # the step's start marked for CUDA graphs, then the compiled forward
    assert region.clone_outputs and region.failed is None
    assert torch.equal(model(inputs), eager)


def test_a_region_that_fails_to_compile_runs_eagerly_with_one_warning(caplog):
    calls = []

    def broken(fn, **kwargs):
        calls.append(kwargs)

        def run(*args):
            raise RuntimeError("inductor: no kernel for this op\nlong trace")

        return run

    model = Doubler()
    with caplog.at_level(logging.INFO, logger="raytrm.train.compile"):
        assert compile_regions(model, CompilePlan("inductor", None, "test plan"), compiler=broken) == ["twice"]
        assert model.twice(torch.ones(2)).tolist() == [2.0, 2.0]
        assert model.twice(torch.ones(1)).tolist() == [2.0]
    assert calls == [{"backend": "inductor"}]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "torch.compile of Doubler.twice failed (RuntimeError: inductor: no kernel for this op); it runs eagerly from "
        "now on"
    ]
    assert "compile plan: test plan" in caplog.text


def test_running_out_of_memory_in_a_compiled_region_is_not_a_compile_failure():
    def out_of_memory(fn, **kwargs):
        def run(*args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        return run

    model = Doubler()
    compile_regions(model, CompilePlan("inductor", None, "test"), compiler=out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        model.twice(torch.ones(2))
    assert model.twice.failed is None  # the governor cuts the micro-batch; the region stays compiled


def test_the_trainer_logs_its_plan_and_stays_eager_on_a_cpu(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="raytrm.train.compile"):
        trainer = Trainer(tiny(training={"device": "cpu"}))
    try:
        assert trainer.compiled == [] and "compile plan: cpu: eager" in caplog.text
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_compiled_round_trains_to_the_eager_numbers(tiny, monkeypatch):
    # aot_eager traces the round through dynamo and AOTAutograd (the graphs inductor would get) and runs them with
    # eager kernels: the capture of both rounds (no-grad and back-propagated) is exercised without a C++ toolchain.
    losses = {}
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        if backend:
            monkeypatch.setattr(
                "raytrm.train.trainer.plan_compile", lambda *a, backend=backend: CompilePlan(backend, None, "test")
            )
        trainer = Trainer(tiny(training={"device": "cpu"}))
        try:
            assert trainer.compiled == (["_round"] if backend else [])
            losses[backend] = [trainer.train_step().loss for _ in range(3)]
            if backend:
                assert trainer.model._round.failed is None
        finally:
            trainer.close()
    assert losses["aot_eager"] == pytest.approx(losses[None], rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["on", "cudagraphs", "auto"])
# Hidden 512: on a Hopper GPU with nvcc the gated SwiGLU product and the qkv projection carrying RoPE serve it.
@pytest.mark.parametrize("variant, hidden", [("mlp_t", 128), ("attention", 128), ("attention", 512)])
def test_a_compiled_step_equals_the_eager_one_on_cuda_within_bf16_noise(tiny, monkeypatch, mode, variant, hidden):
    from raytrm.fastpaths import cublaslt
    from raytrm.fastpaths.hopper import library, rotary_qkv

    launches = []
    launch = rotary_qkv._launch
    monkeypatch.setattr(rotary_qkv, "_launch", lambda *args: launches.append(1) or launch(*args))
    losses = {}
    for compile_mode in ("off", mode):
        torch._dynamo.reset()
        if compile_mode != "off":
            # As in a fresh process: cuBLASLt has no workspace yet, so the first product would make one inside a
            # CUDA graph's warm-up, were it not made before (cublaslt.prepare).
            monkeypatch.setattr(cublaslt, "_workspaces", {})
            monkeypatch.setattr(cublaslt, "_plans", {})
        rope = "rope" if variant == "attention" else "none"
        model = {"variant": variant, "hidden_size": hidden, "pos_encodings": rope}
        # Two micro-batches a step: the second's replays must leave the first's accumulated gradients alone.
        training = {"device": "cuda", "compile": compile_mode, "grad_accum_steps": 2}
        trainer = Trainer(tiny(model=model, training=training))
        try:
            assert trainer.dtype == torch.bfloat16 and len(trainer.slices()) == 2
            counters.clear()
            losses[compile_mode] = [trainer.train_step().loss for _ in range(4)]
            if compile_mode != "off":
                # A round, and on CUDA the step's start and finish, each one graph; CUDA graphs record the round.
                assert trainer.compiled == ["_round", "_start", "_finish"]
                assert all(getattr(trainer.model, name).failed is None for name in trainer.compiled)
                assert not counters["graph_break"], dict(counters["graph_break"])
                graphed = [name for name in trainer.compiled if getattr(trainer.model, name).in_graph_memory]
                assert graphed == ([] if compile_mode == "on" else ["_round"])
        finally:
            trainer.close()
    # bf16 rounds differently in fused kernels; the four steps' losses agree to bf16's ~3 significant digits.
    assert losses[mode] == pytest.approx(losses["off"], rel=2e-2)
    assert bool(launches) == (variant == "attention" and hidden == 512 and library.load())


def test_compiled_artifacts_persist_under_the_cache_dir_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    from raytrm.constants import (
        CACHE_DIR_ENV,
        INDUCTOR_CACHE_DIR_ENV,
        TRITON_CACHE_AUTOTUNING_ENV,
        TRITON_CACHE_DIR_ENV,
    )
    from raytrm.train.compile import use_compile_caches

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(INDUCTOR_CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(TRITON_CACHE_AUTOTUNING_ENV, raising=False)
    monkeypatch.setenv(TRITON_CACHE_DIR_ENV, "/elsewhere/triton")
    settings = use_compile_caches()
    assert settings[INDUCTOR_CACHE_DIR_ENV] == str(tmp_path / "compile" / "inductor")
    assert settings[TRITON_CACHE_DIR_ENV] == "/elsewhere/triton"  # the user's setting stands


@pytest.mark.parametrize("variant", ["attention", "mlp_t"])
def test_trm_names_where_each_region_holds_the_micro_batch(variant):
    from raytrm.config import ModelConfig
    from raytrm.models import TRM

    model = TRM(ModelConfig(variant=variant, hidden_size=16, num_heads=2, L_layers=1), vocab_size=11, seq_len=9)
    seen: dict[str, tuple] = {}
    for name in ("_round", *TRM.EDGES):
        region = getattr(model, name)
        setattr(model, name, lambda *args, name=name, region=region: seen.setdefault(name, args) and region(*args))
    batch = 5  # a size no other dimension has
    inputs = torch.randint(0, 11, (batch, 9))
    data = {"inputs": inputs, "labels": inputs, "puzzle_identifiers": torch.zeros(batch, dtype=torch.int32)}
    model(model.initial_carry(data), data)
    assert set(model.batch_dims) == set(seen)
    for name, args in seen.items():
        dims = model.batch_dims[name]
        assert len(dims) == len(args), name
        for arg, dim in zip(args, dims, strict=True):
            tensors = [arg] if isinstance(arg, torch.Tensor) else [t for t in arg or () if isinstance(t, torch.Tensor)]
            if dim is None:
                assert all(batch not in t.shape for t in tensors), name
            else:
                assert tensors[0].shape[dim] == batch and list(tensors[0].shape).count(batch) == 1, name


@pytest.mark.parametrize("variant", ["attention", "mlp_t"])
def test_a_trm_round_traces_one_graph_for_every_micro_batch_with_the_batch_dynamic_from_the_first(variant):
    # The memory governor walks the micro-batch up through several sizes, and a second run starts at the last one:
    # both must trace the same graphs, dynamic in the batch, or the second finds nothing in the compile caches.
    from raytrm.config import ModelConfig
    from raytrm.models import TRM

    torch._dynamo.reset()
    config = ModelConfig(variant=variant, hidden_size=16, num_heads=2, L_layers=1, H_cycles=2, L_cycles=1)
    model = TRM(config, vocab_size=11, seq_len=9).train()
    traced: list[list[object]] = []

    def backend(graph, example_inputs):
        inputs = [node.meta.get("example_value") for node in graph.graph.find_nodes(op="placeholder")]
        states = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 3]
        traced.append([t.shape[model.batch_dims["_round"][0]] for t in states])
        return graph.forward

    def compiler(fn, **kwargs):
        return torch.compile(fn, backend=backend)

    assert compile_regions(model, CompilePlan("test", None, "test"), compiler=compiler) == ["_round"]
    for batch in (4, 8, 24):
        inputs = torch.randint(0, 11, (batch, 9))
        data = {"inputs": inputs, "labels": inputs, "puzzle_identifiers": torch.zeros(batch, dtype=torch.int32)}
        model(model.initial_carry(data), data)
    # The no-grad rounds and the back-propagated last one: two graphs, at the first size, for all three sizes.
    assert len(traced) == 2
    assert all(sizes and all(isinstance(size, torch.SymInt) for size in sizes) for sizes in traced), traced
    assert model._round.failed is None
