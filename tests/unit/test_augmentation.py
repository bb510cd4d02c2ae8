"""uint8 image datasets normalized on the fly and crop_flip augmentation (dataset.augment, fedslr.md 6.1):
the normalization helper, the augmentation's draws, and the runtime's determinism with augmented uint8 data."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raysim.algorithms.requests import LocalSGD
from raysim.config import validate_config
from raysim.data.cifar import Cifar10Settings
from raysim.data.dataset import Dataset
from raysim.errors import ConfigError, DataError
from raysim.evaluation.columns import client_evaluations
from raysim.models.flat import FlatModel
from raysim.runtime.problem import prepare
from raysim.training.local import ClientData, Inputs, LocalTrainer, model_inputs
from raysim.training.vectorized import VectorizedTrainer
from tests.support.augmentation import MEAN, SHAPE, STD, augmented_config, images, tiny_images
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

EMPTY = np.array([], np.int64)


def test_normalization_is_the_hand_computation_per_channel():
    x, _ = images(5, seed=0)
    want = np.empty(x.shape, np.float32)
    for c in range(3):
        want[:, c] = (x[:, c].astype(np.float32) / np.float32(255) - np.float32(MEAN[c])) / np.float32(STD[c])
    got = model_inputs(x, MEAN, STD)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    ready = want.copy()
    assert model_inputs(ready, None, None) is ready  # float32 datasets pass through untouched


def test_rows_read_through_the_compiled_normalization_are_model_inputs_bits():
    """Inputs.rows and rows_into (gather and normalize uint8 images in one compiled pass, straight into a batch
    buffer) give exactly model_inputs' float32 bits, at the rows asked for, and leave the other rows alone."""
    x, _ = images(30, seed=1)
    inputs = Inputs(MEAN, STD)
    indices = np.array([4, 29, 4, 0, 17])
    np.testing.assert_array_equal(inputs.rows(x, indices), model_inputs(x[indices], MEAN, STD))
    out = np.full((8, int(np.prod(x.shape[1:]))), 7.0, np.float32)
    inputs.rows_into(x, indices, out, np.array([6, 0, 2, 3, 1]))
    np.testing.assert_array_equal(out[[6, 0, 2, 3, 1]], model_inputs(x[indices], MEAN, STD).reshape(5, -1))
    assert (out[[4, 5, 7]] == 7.0).all()


@pytest.mark.parametrize("normalized", [True, False])
def test_an_empty_split_of_a_client_with_per_access_randomness_reads_as_no_rows(normalized):
    """A client whose samples get noise or random labels at every access (quality skew, label poisoning) and whose
    validation split is empty (partition.val_fraction 0): reading that split gives 0 rows of the model's input
    shape, for uint8 images normalized on the fly as for rows stored ready (the quality quickstart's crash)."""
    x, y = images(10, seed=2)
    inputs = Inputs(MEAN, STD) if normalized else Inputs()
    x = x if normalized else model_inputs(x, MEAN, STD)
    for noise, labels in ((0.3, 0), (0.0, 4), (0.3, 4)):
        data = ClientData(x, y, np.arange(8), np.arange(8, 10), EMPTY, noise, labels, inputs=inputs)
        features, targets = data.arrays("val", np.random.default_rng(0))
        assert features.shape == (0, *SHAPE) and features.dtype == np.float32
        assert targets.shape == (0,) and targets.dtype == y.dtype
    out = np.full((2, int(np.prod(SHAPE))), 7.0, np.float32)
    inputs.rows_into(x, EMPTY, out, EMPTY)
    assert (out == 7.0).all()


def test_dataset_refuses_inconsistent_normalization():
    x, y = images(4, seed=0)
    with pytest.raises(DataError, match="one value per channel"):
        Dataset("bad", x, y, 4, mean=(0.5,), std=(0.5,))
    with pytest.raises(DataError, match="uint8"):
        Dataset("bad", x.astype(np.float32), y, 4, mean=MEAN, std=STD)


def test_uint8_dataset_trains_as_its_float32_normalized_twin():
    """Same seed: the sequential trainer on uint8 + mean/std and on the rows normalized up front agree bit for bit
    (with feature noise too, which is drawn after normalization)."""
    x, y = images(90, seed=1)
    model = FlatModel("mlp", SHAPE, 4)
    start = model.initial_parameters(0)
    request = LocalSGD(start=start, epochs=2, lr=0.05, batch_size=16, momentum=0.5)
    for noise in (0.0, 0.2):
        stored = ClientData(x, y, np.arange(70), np.arange(70, 90), EMPTY, noise, inputs=Inputs(MEAN, STD))
        twin = ClientData(model_inputs(x, MEAN, STD), y, np.arange(70), np.arange(70, 90), EMPTY, noise)
        results = [LocalTrainer(model).sgd(request, d, np.random.default_rng(5)) for d in (stored, twin)]
        np.testing.assert_array_equal(results[0].params, results[1].params)
        assert results[0].mean_loss == results[1].mean_loss
        tests = [d.arrays("test", np.random.default_rng(6))[0] for d in (stored, twin)]
        np.testing.assert_array_equal(tests[0], tests[1])


def _candidates(image: np.ndarray, padding: int = 4) -> list[np.ndarray]:
    """Every crop of the zero-padded image, unflipped and flipped (9 x 9 x 2 for padding 4)."""
    _c, h, w = image.shape
    padded = np.pad(image, ((0, 0), (padding, padding), (padding, padding)))
    crops = [padded[:, i : i + h, j : j + w] for i in range(2 * padding + 1) for j in range(2 * padding + 1)]
    return crops + [crop[:, :, ::-1] for crop in crops]


@pytest.mark.parametrize("normalized", [False, True])
def test_crop_flip_batches_are_crops_and_flips_of_the_padded_originals(normalized):
    x, y = images(40, seed=2, low=1)  # no zero pixels: padding shows
    inputs = Inputs(MEAN, STD, "crop_flip") if normalized else Inputs(augment="crop_flip")
    data = ClientData(x, y, np.arange(40), np.arange(0), EMPTY, inputs=inputs)
    indices = np.arange(40)
    xb, yb = data.batch(indices, np.random.default_rng(3), training=True)
    np.testing.assert_array_equal(yb, y)
    assert xb.dtype == (np.float32 if normalized else np.uint8)
    moved = 0
    for k, image in enumerate(xb):
        options = [model_inputs(c[None], MEAN, STD)[0] if normalized else c for c in _candidates(x[k])]
        matches = [i for i, candidate in enumerate(options) if np.array_equal(candidate, image)]
        assert matches, f"sample {k} is no crop/flip of its padded original"
        moved += matches != [40]  # the centred, unflipped crop is candidate 40
    assert moved > 20  # about 3 in 4 (crop with p = .5, flip with p = .5)
    plain, _ = data.batch(indices, np.random.default_rng(3))  # evaluation / gradients: never augmented
    np.testing.assert_array_equal(plain, model_inputs(x, MEAN, STD) if normalized else x)


def test_crop_flip_draws_are_uniform_and_seeded():
    inputs = Inputs(augment="crop_flip", crop_probability=1.0)
    corners, flips = inputs.draw(20000, np.random.default_rng(0))
    assert abs(flips.mean() - 0.5) < 0.02
    assert set(np.unique(corners)) == set(range(9))
    counts = np.bincount(corners.ravel(), minlength=9) / corners.size
    np.testing.assert_allclose(counts, 1 / 9, atol=0.01)
    half = Inputs(augment="crop_flip", padding=8, crop_probability=0.5)  # FedSLR's: crop with p = .5, pad 8 on TIN
    corners, flips = half.draw(20000, np.random.default_rng(0))
    centred = (corners == 8).all(axis=1)
    assert abs(centred.mean() - (0.5 + 0.5 / 17**2)) < 0.02 and corners.max() == 16
    assert abs(flips.mean() - 0.5) < 0.02
    x, y = images(30, seed=4)
    data = ClientData(x, y, np.arange(30), EMPTY, EMPTY, inputs=Inputs(MEAN, STD, "crop_flip"))
    first = data.batch(np.arange(30), np.random.default_rng(9), training=True)[0]
    again = data.batch(np.arange(30), np.random.default_rng(9), training=True)[0]
    other = data.batch(np.arange(30), np.random.default_rng(10), training=True)[0]
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def _assert_vectorized_equals_sequential(clients: list[ClientData], chunk: int, seed: int) -> None:
    """MLP SGD of every client, vectorized `chunk` at a time, gives LocalTrainer's results client by client."""
    model = FlatModel("mlp", SHAPE, 4)
    requests = [
        LocalSGD(start=model.initial_parameters(i), epochs=2, lr=0.05, batch_size=16, momentum=0.5)
        for i in range(len(clients))
    ]

    def jobs():
        pairs = enumerate(zip(requests, clients, strict=True))
        return [(r, d, np.random.default_rng([seed, i])) for i, (r, d) in pairs]

    expected = [LocalTrainer(model).sgd(*job) for job in jobs()]
    actual = VectorizedTrainer(model, chunk=chunk).sgd(jobs())
    for want, got in zip(expected, actual, strict=True):
        assert got.steps == want.steps
        np.testing.assert_allclose(got.params, want.params, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.mean_loss, want.mean_loss, rtol=1e-5)


def test_vectorized_trainer_draws_the_same_augmentation_as_the_sequential_one():
    """Unequal clients, one with feature noise (its batches made step by step), one with its own uint8 array."""
    x, y = images(200, seed=6)
    inputs = Inputs(MEAN, STD, "crop_flip")
    owners = np.random.default_rng(7).permutation(200)
    sizes, start, clients = [7, 33, 50, 1, 40], 0, []
    for i, size in enumerate(sizes):
        features = (255 - x) if i == 4 else x
        clients.append(ClientData(features, y, owners[start : start + size], EMPTY, EMPTY, 0.3 * (i == 2), 0, inputs))
        start += size
    _assert_vectorized_equals_sequential(clients, chunk=3, seed=3)


def test_vectorized_trainer_reads_normalized_uint8_rows_of_all_clients_together_like_the_sequential_one():
    """Clients sharing one uint8 array and its normalization (Fashion-MNIST as stored): one read per step, of the
    real samples only (padding rows keep old finite values, weighted zero), gives LocalTrainer's results."""
    x, y = images(200, seed=8)
    owners = np.random.default_rng(9).permutation(200)
    sizes, start, clients = [7, 33, 50, 1, 40, 16], 0, []
    for size in sizes:
        clients.append(ClientData(x, y, owners[start : start + size], EMPTY, EMPTY, inputs=Inputs(MEAN, STD)))
        start += size
    _assert_vectorized_equals_sequential(clients, chunk=4, seed=4)


@pytest.fixture
def tiny_cifar(monkeypatch):
    """dataset.name = cifar10 loads `tiny_images` (a uint8 source with mean/std) for this test."""
    monkeypatch.setattr(Cifar10Settings, "load", lambda settings, seed: tiny_images(seed))


def test_in_process_vectorized_runs_match_sequential_runs_with_crop_flip(tiny_cifar):
    problem = prepare(augmented_config())
    assert problem.x.dtype == np.uint8 and problem.inputs == Inputs(MEAN, STD, "crop_flip")
    runs = {}
    for mode in ("sequential", "vectorized"):
        sim = InProcess(augmented_config(mode), problem)
        metrics = [sim.round(r) for r in range(3)]
        w = sim.coordinator.global_model()
        runs[mode] = (w, metrics, sim.states, client_evaluations(sim.host.evaluate(w)))
    (w_s, metrics_s, states_s, evals_s), (w_v, metrics_v, states_v, evals_v) = runs["sequential"], runs["vectorized"]
    np.testing.assert_allclose(w_v, w_s, atol=1e-5)
    assert not np.array_equal(w_v, w_s)  # batched kernels sum in another order: the vectorized path ran
    for want, got in zip(metrics_s, metrics_v, strict=True):
        keys = [k for k in want if "seconds" not in k]
        np.testing.assert_allclose([got[k] for k in keys], [want[k] for k in keys], rtol=1e-4, atol=1e-5)
    for client, state in states_s.items():
        for field in dataclasses.fields(state):
            want, got = np.asarray(getattr(state, field.name)), np.asarray(getattr(states_v[client], field.name))
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"client {client} {field.name}")
    for want, got in zip(evals_s, evals_v, strict=True):
        np.testing.assert_allclose(got.gm.test_loss, want.gm.test_loss, rtol=1e-4)


def test_augmentation_changes_training_but_not_evaluation(tiny_cifar):
    """crop_flip moves the trained model; one global model scores the same whatever dataset.augment says."""
    plain, augmented = (InProcess(augmented_config(augment=a)) for a in ("none", "crop_flip"))
    for sim in (plain, augmented):
        sim.round(0)
    assert not np.array_equal(plain.coordinator.global_model(), augmented.coordinator.global_model())
    w = plain.coordinator.global_model()
    tables = [sim.host.evaluate(w) for sim in (plain, augmented)]
    scores = [[dataclasses.asdict(e.gm) for e in client_evaluations(table)] for table in tables]
    np.testing.assert_equal(scores[0], scores[1])  # the global model's scores; personal models differ


def test_augmentation_needs_images():
    config = validate_config(tiny_config(dataset={"name": "synthetic_classification", "augment": "crop_flip"}))
    with pytest.raises(ConfigError, match="dataset.augment"):
        prepare(config)
