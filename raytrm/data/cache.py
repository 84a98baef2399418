"""The dataset a config names: a directory given by the user, or one generated once into the cache and reused."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from raytrm.config import DataConfig
from raytrm.constants import cache_dir

logger = logging.getLogger(__name__)


def generated_dataset_dir(data: DataConfig) -> Path:
    """Where the dataset generated for these settings lives in the cache: a name plus a hash of the settings."""
    recipe = {
        "name": data.name,
        "train": data.train_puzzles,
        "test": data.test_puzzles,
        "augment": data.augment,
        "seed": data.seed,
        **({"givens": data.givens} if data.name == "sudoku" else {"size": data.maze_size}),
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "datasets" / f"{data.name}-{digest}"


def dataset_dir_for(data: DataConfig) -> Path:
    """The dataset directory for a config, generating it first when the config names no path."""
    from raytrm.data.build import build_dataset

    if data.path:
        return Path(data.path).expanduser()
    path = generated_dataset_dir(data)
    if not (path / "test" / "dataset.json").is_file():
        logger.info("generating %s dataset into %s", data.name, path)
        build_dataset(
            data.name,
            path,
            count=data.train_puzzles,
            test_count=data.test_puzzles,
            givens=data.givens,
            augment=data.augment,
            size=data.maze_size,
            seed=data.seed,
        )
    return path


def open_dataset_for(data: DataConfig):
    """(train, test) splits of the config's dataset."""
    from raytrm.data.build import open_dataset

    return open_dataset(dataset_dir_for(data))
