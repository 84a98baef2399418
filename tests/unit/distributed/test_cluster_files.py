"""cluster/: the `ray up` file passes Ray's own checks and the launchd plist parses; both run raytrm's commands as
its parser reads them. `--block` keeps a node's command in the foreground for launchd."""

from __future__ import annotations

import os
import plistlib
import shlex
import signal
import threading
from pathlib import Path

import pytest
import yaml

from raytrm.cli import build_parser
from raytrm.distributed import cluster_commands

CLUSTER = Path(__file__).resolve().parents[3] / "cluster"


def raytrm_args(command: str) -> list[str]:
    """The arguments after `.../raytrm` in a shell command line."""
    words = shlex.split(command)
    return words[next(i for i, w in enumerate(words) if w.endswith("/raytrm")) + 1 :]


def test_the_ray_up_file_passes_rays_checks_and_starts_raytrm_nodes():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load((CLUSTER / "macs.yaml").read_text()))  # what `ray up` does first
    validate_config(config)
    assert config["provider"]["type"] == "local" and config["max_workers"] == len(config["provider"]["worker_ips"])
    assert "~/.ray/auth_token" in config["file_mounts"]
    head = build_parser().parse_args(raytrm_args(config["head_start_ray_commands"][-1]))
    assert (head.action, head.autoscaling_config) == ("head", "~/ray_bootstrap_config.yaml")
    worker = build_parser().parse_args(raytrm_args(config["worker_start_ray_commands"][-1]))
    assert (worker.action, worker.head) == ("join", "$RAY_HEAD_IP:6379")


def test_the_launchd_agent_keeps_a_blocking_join_alive():
    agent = plistlib.loads((CLUSTER / "io.raytrm.node.plist").read_bytes())
    args = build_parser().parse_args(agent["ProgramArguments"][1:])
    assert (args.action, args.block) == ("join", True)
    assert agent["KeepAlive"] == {"SuccessfulExit": False} and agent["RunAtLoad"] is True
    assert agent["EnvironmentVariables"]["PATH"].startswith(str(Path(agent["ProgramArguments"][0]).parent))


def test_block_returns_1_when_the_node_stops():
    states = iter([True, True, False])
    assert cluster_commands.block(poll_s=0.0, running=lambda: next(states)) == 1


def test_block_stops_the_node_on_sigterm(monkeypatch):
    stopped = []
    monkeypatch.setattr(cluster_commands, "stop", lambda: stopped.append(True) or "stopped")
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_:
        cluster_commands.block(poll_s=0.05, running=lambda: True)
    assert exit_.value.code == 0 and stopped == [True]
    assert signal.getsignal(signal.SIGTERM) is before
