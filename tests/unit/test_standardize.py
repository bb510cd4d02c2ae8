"""`dataset.standardize: pixel`: each input coordinate standardized over the pooled samples as AugFL's authors'
code normalizes (`norm` in their DataDivision.py: (x - mean) / (std + 0.001) over axis 0 of the raw data), in place
of the per-channel normalization on the fly; the default keeps the source's per-channel mean and std."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.data.dataset import Dataset
from raysim.errors import DataError
from raysim.runtime.problem import prepare
from tests.support.inprocess import InProcess


def authors_norm(data: np.ndarray) -> np.ndarray:
    """Their function, written out: mean and std over the samples of the float32 data, per coordinate."""
    mu = np.mean(data.astype(np.float32), 0)
    sigma = np.std(data.astype(np.float32), 0)
    return (data.astype(np.float32) - mu) / (sigma + 0.001)


def test_pixel_standardization_is_the_authors_norm_on_the_stored_uint8_values():
    generator = np.random.default_rng(0)
    x = generator.integers(0, 256, size=(50, 1, 4, 4), dtype=np.uint8)
    x[:, 0, 0, 0] = 7  # a constant pixel: std 0, and 0 / 0.001 = 0 there
    images = Dataset("toy", x, np.zeros(50, np.int64), 2, mean=(0.5,), std=(0.25,))
    standardized = images.standardized_per_pixel()
    assert standardized.x.dtype == np.float32 and standardized.mean is None and standardized.std is None
    np.testing.assert_allclose(standardized.x, authors_norm(x), rtol=1e-5, atol=1e-5)
    assert np.all(standardized.x[:, 0, 0, 0] == 0)
    np.testing.assert_allclose(standardized.x.mean(axis=0), 0, atol=1e-5)
    assert np.all(np.abs(standardized.x.std(axis=0)[0].ravel()[1:] - 1) < 1e-3)


def test_multimodal_rows_are_refused_in_one_line():
    from raysim.data.sources import load_dataset

    dataset = load_dataset("crisismmd_synthetic", samples=32)
    with pytest.raises(DataError, match="^dataset crisismmd_synthetic: standardize=pixel .* not multimodal rows$"):
        dataset.standardized_per_pixel()


def test_a_run_with_pixel_standardization_trains_on_the_standardized_pool(fmnist_tenth):
    """The hosts get the standardized float32 pool (no on-the-fly normalization left) and a round trains on it."""
    base = {
        "algorithm": {"name": "fedavg", "epochs": 1},
        "model": {"name": "mlp"},
        "clients": {"count": 4},
        "dataset": {"name": "fashion_mnist", "root": str(fmnist_tenth)},
    }
    channel = prepare(validate_config(base))
    config = validate_config({**base, "dataset": {**base["dataset"], "standardize": "pixel"}})
    pixel = prepare(config)
    assert channel.x.dtype == np.uint8 and channel.inputs.mean is not None
    assert pixel.inputs.mean is None and pixel.x.dtype == np.float32
    np.testing.assert_allclose(pixel.x, authors_norm(channel.x), rtol=1e-5, atol=1e-4)
    run = InProcess(config, pixel)
    metrics = run.round(0, [0, 1, 2, 3])
    assert metrics and all(np.isfinite(value) for value in metrics.values())
    assert np.isfinite(run.server.w).all() and not np.array_equal(run.server.w, pixel.init_params)
