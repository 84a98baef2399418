"""The names of Ray's that raytrm needs and Ray does not make public (Ray 2.60), each used here only.

tests/unit/test_private_names.py checks each against the installed Ray and fails naming it when a release moves it,
and checks that no other module of raytrm reaches into Ray's private modules.
"""

from __future__ import annotations

from typing import Any


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Each alive node's free resources by node id: what `cluster status` shows as a busy machine."""
    from ray._private.state import available_resources_per_node as per_node

    return per_node()


def auto_address() -> str:
    """HOST:PORT of the cluster `--address auto` means here, as ray.init reads it ($RAY_ADDRESS, else this machine's
    node's cluster); raises ConnectionError or ValueError where there is none."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address("auto")


def stdstream_dispatcher() -> tuple[Any, Any]:
    """Ray's dispatcher of the lines its job's processes forward to the driver, and its filter of the autoscaler's
    events; raises ImportError in a Ray without them."""
    from ray._private.worker import filter_autoscaler_events, global_worker_stdstream_dispatcher

    return global_worker_stdstream_dispatcher, filter_autoscaler_events


def gcs_client(address: str) -> Any:
    """A client of the head's GCS at HOST:PORT, connected with this process's token: one authenticated call."""
    from ray._raylet import GcsClient

    return GcsClient(address=address)


def torch_config_with_setup(backend: str, setup: Any) -> Any:
    """Ray Train's TorchConfig for backend whose worker group runs setup(worker_group) before its process group
    starts: Ray Train has no public hook between starting the workers and joining them."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    class Backend(_TorchBackend):
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            setup(worker_group)
            super().on_start(worker_group, backend_config)

    class Config(TorchConfig):
        @property
        def backend_cls(self) -> type:
            return Backend

    return Config(backend=backend)
