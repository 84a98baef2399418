"""raytrm.distributed.launch: workers joined in one process group on this machine, each seeing the caller's
environment and working directory as they are at the call (on Linux the workers are forked from a server started at
the first call, whose own environment is that first call's)."""

from __future__ import annotations

import os

import pytest

from raytrm.distributed.launch import spawn


def where(rank, world_size, device, name):
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "size": dist.get_world_size(), "value": os.environ.get(name), "cwd": os.getcwd()}


def fails(rank, world_size, device):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    return rank


@pytest.mark.slow  # worker processes
def test_workers_see_the_callers_environment_and_directory_of_the_moment(tmp_path, monkeypatch):
    first = spawn(where, 2, "RAYTRM_TEST_LAUNCH")
    assert [(r["rank"], r["size"]) for r in first] == [(0, 2), (1, 2)]
    monkeypatch.setenv("RAYTRM_TEST_LAUNCH", "set after the first call")
    monkeypatch.chdir(tmp_path)
    second = spawn(where, 2, "RAYTRM_TEST_LAUNCH")
    assert {r["value"] for r in second} == {"set after the first call"}
    assert {r["cwd"] for r in second} == {str(tmp_path)}


@pytest.mark.slow  # worker processes
def test_a_failing_rank_is_raised_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: rank 1 gives up"):
        spawn(fails, 2)
