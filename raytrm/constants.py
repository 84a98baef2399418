"""Every environment-variable knob of raytrm, declared once with its default."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

#: Directory of tiers.yaml and the search spaces; default: the package's own tune_spaces/ (package data).
SPACES_DIR_ENV = "RAYTRM_SPACES_DIR"
#: Where generated datasets and other reusable artifacts are cached.
CACHE_DIR_ENV = "RAYTRM_CACHE_DIR"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "raytrm"
#: Log level of the `raytrm` command (DEBUG, INFO, WARNING).
LOG_LEVEL_ENV = "RAYTRM_LOG_LEVEL"
DEFAULT_LOG_LEVEL = "INFO"
#: Ray's own: the cluster a driver belongs to. Ray sets it for a job's driver (`ray job submit`), so `raytrm tune` or
#: `raytrm train` started as a job joins the cluster it was submitted to without --address.
RAY_ADDRESS_ENV = "RAY_ADDRESS"

#: torch's gloo: the network interface its sockets bind and advertise. A cluster's run sets it on every worker to the
#: interface of the network its fastest paths share (raytrm.distributed.gloo_path).
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

#: Ray custom resource every raytrm node advertises one unit of: a tuning trial takes it, so trials that share a
#: machine never run at once while different machines run in parallel.
RESOURCE_MACHINE = "raytrm_machine"
#: Prefix of the per-tier Ray resource a node advertises ("raytrm_tier:<tier name>", one unit); see tier_resource.
TIER_RESOURCE_PREFIX = "raytrm_tier:"

#: Device fast paths (raytrm.fastpaths): "on" runs each named operation on the first backend that serves it, "off"
#: runs every operation's plain formula.
FASTPATHS_ENV = "RAYTRM_FASTPATHS"
DEFAULT_FASTPATHS = "on"


def tier_resource(tier: str) -> str:
    """The Ray resource name that marks a node as a machine of `tier`."""
    return f"{TIER_RESOURCE_PREFIX}{tier}"


def spaces_dir() -> Path:
    """The tier table's and the search spaces' directory: $RAYTRM_SPACES_DIR, else the one the package ships."""
    env = os.environ.get(SPACES_DIR_ENV)
    if env:
        return Path(env)
    # raytrm is installed as files, never zipped (the CUDA sources build from their paths): the data is a directory.
    return Path(str(resources.files("raytrm") / "tune_spaces"))


def named_file(path: str | os.PathLike) -> Path | None:
    """The file of spaces_dir() that a bare name stands for ('quick', 'tiers'), where no such path exists here."""
    given = Path(path)
    if given.exists() or given.suffix:
        return None
    named = spaces_dir() / f"{given}.yaml"
    return named if named.is_file() else None


def cache_dir() -> Path:
    """The cache directory: $RAYTRM_CACHE_DIR, else ~/.cache/raytrm."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else DEFAULT_CACHE_DIR


def fastpaths_setting() -> str:
    """$RAYTRM_FASTPATHS as given, lower case: on (the default) or off; raytrm.fastpaths.registry checks it."""
    return os.environ.get(FASTPATHS_ENV, DEFAULT_FASTPATHS).strip().lower()


# -- compile caches (raytrm.train.compile.use_compile_caches) --
#: torch's and Triton's own knobs for where compiled artifacts persist. Where unset, raytrm points them under its
#: cache dir, so that runs and tuning trials on one machine reuse what an earlier one compiled (each cache is keyed by
#: what it compiled: a changed model compiles anew).
INDUCTOR_CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_DIR_ENV = "TRITON_CACHE_DIR"
TRITON_CACHE_AUTOTUNING_ENV = "TRITON_CACHE_AUTOTUNING"  # Triton >= 3.4 keeps @triton.autotune's picks on disk


def compile_cache_env() -> dict[str, str]:
    """The compile caches' settings raytrm gives where they are unset: directories under the cache dir's compile/."""
    root = cache_dir() / "compile"
    return {
        INDUCTOR_CACHE_DIR_ENV: str(root / "inductor"),
        TRITON_CACHE_DIR_ENV: str(root / "triton"),
        TRITON_CACHE_AUTOTUNING_ENV: "1",
    }
