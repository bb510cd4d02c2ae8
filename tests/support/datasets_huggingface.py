"""What the datasets_huggingface tests of several tiers share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")


def _tabular(n: int = 200, seed: int = 0):
    """Three Gaussian clusters in 10 dimensions as a list-of-floats column plus plain int labels."""
    generator = np.random.default_rng(seed)
    centres = generator.normal(0.0, 3.0, size=(3, 10))
    labels = generator.integers(0, 3, size=n)
    rows = centres[labels] + generator.normal(size=(n, 10))
    features = datasets.Features(
        {"features": datasets.List(datasets.Value("float32")), "target": datasets.Value("int64")}
    )
    return datasets.Dataset.from_dict({"features": rows.tolist(), "target": labels.tolist()}, features=features)


def _save(table, folder: Path) -> str:
    table.save_to_disk(str(folder))
    return str(folder)
