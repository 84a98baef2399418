"""Global batches as a pure function of (seed, step): an endless stream of epoch permutations, cut in batches.

Because batch k's samples depend only on the seed and k, a resumed run, a retried step and a worker restart all see
exactly the samples an uninterrupted run would: nothing lost, nothing doubled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def batch_indices(num_samples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Sample indices of global batch `step` (0-based); batches run across epoch boundaries without gaps."""
    start = step * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    filled = 0
    while filled < batch_size:
        epoch, offset = divmod(start + filled, num_samples)
        take = min(batch_size - filled, num_samples - offset)
        out[filled : filled + take] = epoch_permutation(num_samples, seed, epoch)[offset : offset + take]
        filled += take
    return out


class _BatchSampler(Sampler):
    """Yields the index arrays of batches first_step, first_step + 1, ..."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, first_step: int) -> None:
        self.num_samples, self.batch_size, self.seed, self.first_step = num_samples, batch_size, seed, first_step

    def __iter__(self) -> Iterator[np.ndarray]:
        step = self.first_step
        while True:
            yield batch_indices(self.num_samples, self.batch_size, self.seed, step)
            step += 1


class _Gather(Dataset):
    """Turns an index array into a batch of tensors with the dataset's gather function."""

    def __init__(self, gather: Callable[[np.ndarray], dict[str, np.ndarray]]) -> None:
        self.gather = gather

    def __getitem__(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.ascontiguousarray(v)).long() for k, v in self.gather(indices).items()}


def global_batches(
    gather: Callable[[np.ndarray], dict[str, np.ndarray]],
    num_samples: int,
    batch_size: int,
    seed: int,
    first_step: int = 0,
    workers: int = 0,
) -> Iterator[dict[str, Any]]:
    """Endless iterator of global batches starting at first_step; workers > 0 gather in background processes."""
    sampler = _BatchSampler(num_samples, batch_size, seed, first_step)
    if workers == 0:
        data = _Gather(gather)
        return (data[idx] for idx in sampler)
    loader = DataLoader(
        _Gather(gather),
        sampler=sampler,
        batch_size=None,
        num_workers=workers,
        persistent_workers=True,
        prefetch_factor=2,
    )
    return iter(loader)
