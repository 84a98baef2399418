"""Loading the TRM reference from a user's checkout: clear errors, and the import mechanics on a fake checkout.

The fake checkout written here only mimics the reference's layout (config/arch/trm.yaml naming classes under a
top-level `models` package); its classes are tiny stand-ins written for this test.
"""

from __future__ import annotations

import functools
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch

from benchmarks import reference
from benchmarks.reference import ReferenceTrainer, load_reference_classes
from benchmarks.timing import count_flops
from benchmarks.trm import reference_experiment
from raytrm.data.build import build_dataset
from raytrm.errors import UserError

ARCH = """\
name: recursive_reasoning.trm@FakeModel
loss:
  name: losses@FakeLossHead
  loss_type: fake_loss
hidden_size: 8
"""

FILES = {
    "models/common.py": """
        def scale():
            return 2.0
    """,
    "models/recursive_reasoning/trm.py": """
        import torch
        from torch import nn

        from models.common import scale


        class FakeModel(nn.Module):
            def __init__(self, config_dict):
                super().__init__()
                self.config_dict = config_dict
                self.weight = nn.Parameter(torch.ones(config_dict["hidden_size"]))
                self.puzzle_emb = nn.Module()
                self.puzzle_emb.register_buffer("weights", torch.zeros(1, config_dict["hidden_size"]))
                self.made_on = torch.empty(0).device
                self.initial_carries = 0

            def initial_carry(self, batch):
                self.initial_carries += 1
                return torch.zeros(batch["inputs"].shape[0])

            def forward(self, carry, batch):
                out = scale() * (batch["inputs"].float().mean(-1, keepdim=True) * self.weight).sum(-1)
                return carry + 1, out
    """,
    "models/losses.py": """
        import torch
        from torch import nn


        class FakeLossHead(nn.Module):
            def __init__(self, model, loss_type):
                super().__init__()
                self.model, self.loss_type = model, loss_type

            def initial_carry(self, batch):
                return self.model.initial_carry(batch)

            def forward(self, return_keys, **model_kwargs):
                carry, out = self.model(**model_kwargs)
                loss = out.square().sum()
                return carry, loss, {"count": torch.tensor(float(len(out)))}, {}, torch.tensor(False)
    """,
    "models/sparse_embedding.py": """
        class CastedSparseEmbeddingSignSGD_Distributed:
            def __init__(self, params, world_size, lr, weight_decay):
                self.buffers, self.world_size, self.steps = list(params), world_size, 0

            def step(self):
                self.steps += 1

            def zero_grad(self):
                pass
    """,
    "models/ema.py": """
        class EMAHelper:
            def __init__(self, mu):
                self.mu, self.updates = mu, 0

            def register(self, module):
                self.module = module

            def update(self, module):
                self.updates += 1
    """,
}


def fake_checkout(root: Path, files: dict[str, str] = FILES, arch: str = ARCH) -> Path:
    (root / "config" / "arch").mkdir(parents=True)
    (root / reference.ARCH_FILE).write_text(arch)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_missing_directory_names_it_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no-such-dir: no such directory; fix: .*git clone"):
        load_reference_classes(tmp_path / "no-such-dir")


def test_directory_that_is_not_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"no config/arch/trm.yaml, so this is not a TRM reference checkout; fix: "):
        load_reference_classes(tmp_path)


def test_checkout_without_the_model_module(tmp_path: Path) -> None:
    files = {k: v for k, v in FILES.items() if not k.endswith("trm.py")}
    expected = r"models/recursive_reasoning/trm\.py: not found \(named by .*trm\.yaml\), so .* is not a TRM reference"
    with pytest.raises(UserError, match=expected):
        load_reference_classes(fake_checkout(tmp_path, files))


def test_missing_dependency_says_what_to_install(tmp_path: Path) -> None:
    files = {**FILES, "models/losses.py": "import raytrm_absent_dependency\n"}
    with pytest.raises(UserError, match=r"needs the package 'raytrm_absent_dependency'.*pip install raytrm_absent"):
        load_reference_classes(fake_checkout(tmp_path, files))


def test_missing_class_is_named(tmp_path: Path) -> None:
    arch = ARCH.replace("@FakeModel", "@Renamed")
    with pytest.raises(UserError, match=r"trm\.py: no class 'Renamed'"):
        load_reference_classes(fake_checkout(tmp_path, arch=arch))


def test_loads_the_checkout_and_leaves_imports_as_they_were(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = types.ModuleType("models")  # some other top-level `models` the process already had
    monkeypatch.setitem(sys.modules, "models", other)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path_before = list(sys.path)
    classes = load_reference_classes(fake_checkout(tmp_path))
    assert (classes.model.__name__, classes.loss_head.__name__, classes.loss_type) == (
        "FakeModel",
        "FakeLossHead",
        "fake_loss",
    )
    assert classes.ema.__name__ == "EMAHelper"
    assert sys.modules["models"] is other
    assert not [name for name in sys.modules if name.startswith("models.")]
    assert sys.path == path_before
    assert sys.dont_write_bytecode is False
    assert not list(tmp_path.rglob("__pycache__"))  # the checkout is left as it was


def test_trainer_drives_the_reference_step(tmp_path: Path) -> None:
    data_dir = build_dataset("sudoku", tmp_path / "sudoku", count=4, test_count=1)
    experiment = reference_experiment("mlp_t", 8, 4, None, "cpu", data_dir, "auto")
    checkout = fake_checkout(tmp_path / "ref")
    trainer = ReferenceTrainer(checkout, experiment, data_dir, torch.device("cpu"), torch.float32)
    inner = trainer.model.model
    assert inner.config_dict["forward_dtype"] == "float32"
    assert inner.config_dict["mlp_t"] is True
    assert (inner.config_dict["batch_size"], inner.config_dict["seq_len"]) == (4, 81)
    before = inner.weight.detach().clone()
    for _ in range(2):
        metrics = trainer.train_step()
    assert metrics == {"count": 4.0}
    assert inner.initial_carries == 1
    assert torch.equal(trainer.carry, torch.full((4,), 2.0))
    assert not torch.equal(inner.weight, before)  # AdamW stepped on the loss's gradient
    sparse, adamw = trainer.optimizers
    assert (sparse.steps, sparse.world_size, sparse.buffers) == (2, 1, [inner.puzzle_emb.weights])
    assert isinstance(adamw, torch.optim.AdamW)
    assert trainer.ema is not None and trainer.ema.updates == 2


def test_the_reference_compiles_as_pretrain_does_and_its_flops_are_counted_once_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    data_dir = build_dataset("sudoku", tmp_path / "sudoku", count=4, test_count=1)
    experiment = reference_experiment("mlp_t", 8, 4, None, "cpu", data_dir, "auto")
    trainer = ReferenceTrainer(
        fake_checkout(tmp_path / "ref"), experiment, data_dir, torch.device("cpu"), torch.float32, compile_model=True
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            count_flops(trainer.train_step)
        assert compiled == []  # the FLOP counter ran the step eagerly
        assert not [w for w in caught if "hooks" in str(w.message)]  # compiled in place: no wrapper's hooks too
        assert trainer.train_step() == {"count": 4.0} and len(compiled) == 1
        assert torch.equal(trainer.carry, torch.full((4,), 2.0))
    finally:
        trainer.close()


def test_einops_stand_in_permutes_axes() -> None:
    x = torch.arange(24).reshape(1, 2, 3, 4)
    assert torch.equal(reference._rearrange(x, "B S H D -> B H S D"), x.transpose(1, 2))
    with pytest.raises(UserError, match="pip install einops"):
        reference._rearrange(x, "B S H D -> B S (H D)")


def test_cli_reports_a_wrong_reference_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.cli import main

    assert main(["trm", "--reference", str(tmp_path), "--hidden", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"benchmarks: error: {tmp_path.resolve()}: no config/arch/trm.yaml")
    assert "\n" not in err
