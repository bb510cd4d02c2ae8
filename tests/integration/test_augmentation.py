"""uint8 image datasets normalized on the fly and crop_flip augmentation (dataset.augment, fedslr.md 6.1):
the normalization helper, the augmentation's draws, and the runtime's determinism with augmented uint8 data."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data.cifar import Cifar10Settings
from raysim.runtime.driver import run_experiment
from tests.support.augmentation import augmented_config, tiny_images


@pytest.fixture
def tiny_cifar(monkeypatch):
    """dataset.name = cifar10 loads `tiny_images` (a uint8 source with mean/std) for this test."""
    monkeypatch.setattr(Cifar10Settings, "load", lambda settings, seed: tiny_images(seed))


def _final(num_hosts: int, mlflow_uri: str):
    config = augmented_config(num_hosts=num_hosts, tracking={"uri": mlflow_uri, "experiment": "augmentation"}, rounds=2)
    captured = {}

    def inspect(round_index, simulation):
        captured["states"] = simulation.client_states()
        captured["w"] = simulation.server_state().w

    result = run_experiment(config, show_progress=False, inspect=inspect)
    return captured, result.final


def test_ray_runs_with_crop_flip_are_identical_with_1_and_3_hosts(ray_local, mlflow_uri, tiny_cifar):
    """Augmentation draws come from each client's keyed stream: packing into 1 or 3 hosts changes no bit."""
    one, evaluations_one = _final(1, mlflow_uri)
    three, evaluations_three = _final(3, mlflow_uri)
    np.testing.assert_array_equal(one["w"], three["w"])
    for client_id, state in one["states"].items():
        np.testing.assert_array_equal(state.theta, three["states"][client_id].theta)
    np.testing.assert_equal([e.row() for e in evaluations_one], [e.row() for e in evaluations_three])
