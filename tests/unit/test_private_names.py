"""Other libraries' private names: each one raytrm uses lives in one module, and still exists in the installed
library (a release that moves one fails here, naming it, instead of deep inside a run)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "raytrm"

#: Each private name, where raytrm uses it, and why no public one serves.
ALLOWED = {
    "raytrm/distributed/ray_internals.py": "Ray keeps the per-node free resources, `auto`, the forwarded lines' "
    "dispatcher, the GCS client and Ray Train's torch backend (the hook before the process group) private",
    "raytrm/tune/studies.py": "optuna builds a live Trial only from a trial's private storage id",
    "raytrm/train/side_by_side.py": "torch has no public way to ask whether a dispatch mode or the profiler watches",
    "raytrm/train/compile.py": "dynamo's dynamic-dimension hint and AOTAutograd's cache switch are documented only "
    "under torch._dynamo and torch._functorch",
    "raytrm/fastpaths/onednn.py": "oneDNN's packed linear is an internal op of torch (inductor's own)",
    "raytrm/fastpaths/cublaslt.py": "cuBLASLt needs the raw CUDA stream, which torch exposes only in torch._C",
    "raytrm/sync/membership.py": "torch sets a live process group's timeout only through a private setter, and "
    "says a group's timeout only in its backend's private options",
}
LIBRARIES = ("torch", "ray", "optuna")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:])


def _uses(path: Path) -> list[str]:
    """The private names of LIBRARIES a module imports or reaches, and any `_trial_id`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            names = [dotted] if dotted else []
            if node.attr == "_trial_id":
                found.append(f"{path.name}:{node.lineno} ._trial_id")
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in LIBRARIES and _private(n)]
    return found


def test_private_names_of_other_libraries_live_in_their_one_module_each():
    root = PACKAGE.parent
    stray = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(root)) not in ALLOWED
        for use in _uses(path)
    ]
    assert not stray, "private names of other libraries outside their modules (see ALLOWED):\n" + "\n".join(stray)


def test_every_allowed_module_still_needs_its_exception():
    root = PACKAGE.parent
    unused = [name for name in ALLOWED if not _uses(root / name)]
    assert not unused, f"these modules no longer use a private name; drop them from ALLOWED: {unused}"


def test_the_private_names_of_ray_that_raytrm_uses_exist():
    for module, name in [
        ("ray._private.state", "available_resources_per_node"),
        ("ray._private.services", "canonicalize_bootstrap_address"),
        ("ray._private.worker", "filter_autoscaler_events"),
        ("ray._private.worker", "global_worker_stdstream_dispatcher"),
        ("ray._raylet", "GcsClient"),
        ("ray.train.torch.config", "_TorchBackend"),
    ]:
        found = getattr(importlib.import_module(module), name, None)
        assert found is not None, f"{module}.{name} is gone from this Ray: update raytrm/distributed/ray_internals.py"
    dispatcher = importlib.import_module("ray._private.worker").global_worker_stdstream_dispatcher
    for method in ("add_handler", "remove_handler"):
        assert callable(getattr(dispatcher, method, None)), f"Ray's line dispatcher has no {method}: update run_logs"


def test_optuna_still_builds_a_live_trial_from_a_frozen_trials_id():
    import optuna

    from raytrm.tune.studies import running_trial

    study = optuna.create_study()
    asked = study.ask()
    frozen = study.get_trials(deepcopy=False)[0]
    assert hasattr(frozen, "_trial_id"), "optuna's FrozenTrial lost _trial_id: update raytrm.tune.studies.running_trial"
    trial = running_trial(study, frozen)
    trial.set_user_attr("kept", 1)
    study.tell(trial, 1.0)
    assert asked.number == trial.number and study.trials[0].user_attrs == {"kept": 1}


def test_torchs_private_names_that_raytrm_uses_exist():
    import torch._functorch.config

    assert callable(getattr(torch._dynamo, "maybe_mark_dynamic", None)), "update raytrm/train/compile.py"
    assert hasattr(torch._functorch.config, "autograd_cache_allow_custom_autograd_functions"), "update compile.py"
    assert callable(getattr(torch._C, "_len_torch_dispatch_stack", None)), "update raytrm/train/side_by_side.py"
    assert callable(getattr(torch._C._autograd, "_profiler_enabled", None)), "update raytrm/train/side_by_side.py"
    if torch.backends.mkldnn.is_available():
        ops = torch.ops.mkldnn
        for name in ("_linear_pointwise", "_reorder_linear_weight"):
            assert hasattr(ops, name), f"torch.ops.mkldnn.{name} is gone: update raytrm/fastpaths/onednn.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torchs_raw_cuda_stream_exists():
    found = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    assert callable(found), "torch._C._cuda_getCurrentRawStream is gone: update raytrm/fastpaths/cublaslt.py"
