"""CPU thread settings: torch's pools for this process, the OpenMP/BLAS variables for the processes it starts."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

#: Read by OpenMP, MKL, Accelerate (vecLib) and numexpr at process start: they reach child processes only.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def apply_threads(threads: int | None, interop_threads: int | None = None) -> dict[str, int]:
    """Set torch's intra- and inter-op threads and export the thread variables; returns what is in effect."""
    if threads:
        torch.set_num_threads(threads)
        for name in THREAD_ENV_VARS:
            os.environ[name] = str(threads)
    if interop_threads and interop_threads != torch.get_num_interop_threads():
        try:
            torch.set_num_interop_threads(interop_threads)
        except RuntimeError:
            # torch allows this once per process, before any parallel work: a reused worker keeps its pool.
            logger.warning(
                "inter-op threads stay at %d: torch fixes them once per process (asked for %d)",
                torch.get_num_interop_threads(),
                interop_threads,
            )
    effective = {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()}
    logger.info("threads: %d intra-op, %d inter-op", effective["threads"], effective["interop_threads"])
    return effective
