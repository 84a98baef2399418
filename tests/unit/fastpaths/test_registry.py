"""The registry of fast paths (raytrm.fastpaths.registry): the first backend that serves runs, else the plain formula;
one switch turns every backend off; each choice is logged once per operation, device and outcome, and traces under
torch.compile without a graph break."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from raytrm import constants
from raytrm.errors import UserError
from raytrm.fastpaths import registry
from raytrm.fastpaths.registry import Backend
from raytrm.models import ops

OP = "test_scale"


@pytest.fixture
def scale(monkeypatch):
    """An operation test_scale (x * k, plain) with two backends: `first` serves fp64 only, `second` serves no
    gradient; each tags its result so that the test sees which one ran. The registry's tables are restored after."""
    monkeypatch.setattr(registry, "_backends", dict(registry._backends))
    monkeypatch.setattr(registry, "_formulas", dict(registry._formulas))
    monkeypatch.setattr(registry, "_logged", set())

    def first_why_not(x: torch.Tensor, k: float) -> str | None:
        return None if x.dtype == torch.float64 else "not fp64"

    def second_why_not(x: torch.Tensor, k: float) -> str | None:
        return "a gradient is recorded" if torch.is_grad_enabled() else None

    registry.register(
        Backend(OP, "first", first_why_not, lambda x, k: x * k + 1000),
        Backend(OP, "second", second_why_not, lambda x, k: x * k + 2000),
    )

    @registry.op(OP)
    def plain(x: torch.Tensor, k: float) -> torch.Tensor:
        return x * k

    return plain


def test_the_first_backend_that_serves_runs_and_where_none_does_the_plain_formula(scale):
    x = torch.ones(3)
    assert scale(x.double(), 2.0).tolist() == [1002.0] * 3  # first
    with torch.no_grad():
        assert scale(x, 2.0).tolist() == [2002.0] * 3  # first declines (fp32), second serves (no gradient)
    assert scale(x, 2.0).tolist() == [2.0] * 3  # both decline: the formula
    assert registry.served(OP, x.double(), 2.0) and not registry.served(OP, x, 2.0)
    assert registry.call(OP, x, 3.0).tolist() == [3.0] * 3
    assert registry.formula(OP)(x.double(), 2.0).tolist() == [2.0] * 3
    assert [b.name for b in registry.backends(OP)] == ["first", "second"]


def test_the_switch_turns_every_backend_off(scale, monkeypatch):
    monkeypatch.setattr(registry, "ENABLED", False)
    assert scale(torch.ones(2, dtype=torch.float64), 2.0).tolist() == [2.0, 2.0]
    assert registry.choose(OP, torch.ones(2, dtype=torch.float64), 2.0) is None
    assert not registry.served(OP, torch.ones(2, dtype=torch.float64), 2.0)
    # The model's operations: F.linear's exact output where oneDNN (on this CPU) or another backend would serve.
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, 48), torch.randn(40, 48)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))
    for op, backends in registry._backends.items():
        assert all(b.why_not is not None for b in backends)  # registered, and never asked while off
        assert registry.choose(op, x) is None


def test_the_environment_variable_is_read_as_on_or_off(monkeypatch):
    monkeypatch.delenv(constants.FASTPATHS_ENV, raising=False)
    assert registry.fastpaths_on()
    monkeypatch.setenv(constants.FASTPATHS_ENV, "OFF")
    assert not registry.fastpaths_on()
    monkeypatch.setenv(constants.FASTPATHS_ENV, "of")
    with pytest.raises(UserError, match=r"RAYTRM_FASTPATHS='of': expected on or off"):
        registry.fastpaths_on()


@pytest.mark.slow
def test_a_misspelt_switch_is_one_line_and_exit_code_2():
    env = {**os.environ, constants.FASTPATHS_ENV: "of"}
    code = "from raytrm.cli import main; raise SystemExit(main(['train', '--steps', '1', '--out', 'unused']))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert "RAYTRM_FASTPATHS='of': expected on or off" in lines[0]


def test_each_choice_is_logged_once_per_operation_device_and_outcome_with_its_reason(scale, caplog):
    x = torch.ones(3)
    with caplog.at_level(logging.DEBUG, logger="raytrm.fastpaths.registry"):
        for _ in range(3):
            scale(x, 2.0)
            scale(x.double(), 2.0)
        with torch.no_grad():
            scale(x, 2.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "test_scale on cpu: the plain formula (first: not fp64; second: a gradient is recorded)",
        "test_scale on cpu: fast path first",
        "test_scale on cpu: fast path second (before it, first: not fp64)",
    ]
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.INFO, logging.INFO]


def test_switched_off_the_reason_says_so(scale, caplog, monkeypatch):
    monkeypatch.setattr(registry, "ENABLED", False)
    with caplog.at_level(logging.DEBUG, logger="raytrm.fastpaths.registry"):
        scale(torch.ones(1, dtype=torch.float64), 2.0)
    off = "every backend: switched off (RAYTRM_FASTPATHS=off)"
    assert caplog.messages == [f"test_scale on cpu: the plain formula ({off})"]


def test_the_choice_traces_under_torch_compile_without_a_graph_break_and_is_logged_while_tracing(scale, caplog):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: scale(x, 2.0) + 1, backend="eager", fullgraph=True)  # a graph break raises
    x = torch.ones(2)
    with caplog.at_level(logging.DEBUG, logger="raytrm.fastpaths.registry"):
        assert compiled(x).tolist() == [3.0, 3.0]  # the formula: both decline
        with torch.no_grad():
            assert compiled(x).tolist() == [2003.0, 2003.0]  # second, in a graph of its own
        assert compiled(x.double()).tolist() == [1003.0, 1003.0]
        caplog.clear()
        compiled(x)  # the compiled code runs no Python of the choice: nothing is logged again
    assert not counters["graph_break"]
    assert caplog.messages == []
    torch._dynamo.reset()


def test_the_models_operations_trace_without_a_graph_break():
    from raytrm.models.layers import Attention, RotaryEmbedding, SwiGLU

    torch._dynamo.reset()
    counters.clear()
    mlp, attention = SwiGLU(64, 4.0), Attention(64, 4)
    rope = RotaryEmbedding(16, 9, 10000.0)()

    def block(x: torch.Tensor) -> torch.Tensor:
        cols = x.reshape(9, -1)
        x = SwiGLU.mix_norm(mix, cols, 1e-5).view_as(x)
        return mlp.add_norm(x + attention(x, rope), 1e-5)

    mix = SwiGLU(9, 4.0)
    x = torch.randn(2, 9, 64)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    for dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(compiled(x.to(dtype)), block(x.to(dtype)), rtol=2e-2, atol=2e-2)
    assert not counters["graph_break"]
    torch._dynamo.reset()


def test_with_every_backend_off_the_model_still_trains_to_the_same_numbers(tiny, monkeypatch):
    from raytrm.train.trainer import Trainer

    losses = {}
    for enabled in (True, False):
        monkeypatch.setattr(registry, "ENABLED", enabled)
        trainer = Trainer(tiny(training={"device": "cpu"}))
        try:
            losses[enabled] = [trainer.train_step().loss for _ in range(3)]
        finally:
            trainer.close()
    # On this CPU oneDNN's products and the column-block mixing sum in another order than the plain formulas.
    assert losses[False] == pytest.approx(losses[True], rel=1e-4)


@pytest.mark.slow
def test_a_process_that_trains_without_compiling_never_imports_torchs_compiler():
    # torch's compiler takes about a second to import: every Ray worker and every trial process would pay it.
    code = (
        "import sys, raytrm.train.run.training, raytrm.distributed.ray_train, raytrm.tune.trial\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
