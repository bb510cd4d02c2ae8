"""`raysim pretrain` (raysim.launch.pretrain, raysim.algorithms.augfl.teacher) and its versioned weights files
(raysim.models.weights): the file's header and checksum, a run's teacher equal to the file, the one-line refusal of a
corrupted or mismatched file, the authors' recipe as defaults, and no file left by an interrupted pretraining."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from raysim.algorithms.augfl.settings import AugFlSettings
from raysim.algorithms.requests import TrainModel
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.launch import pretrain
from raysim.models.weights import FORMAT_VERSION, checksum, read_weights, write_weights
from raysim.runtime.problem import prepare
from tests.support.augfl import CRD, PRETRAIN_META
from tests.support.experiments import tiny_config


def _config(**algorithm):
    return validate_config(tiny_config(algorithm={**CRD, "teacher_epochs": 1, **algorithm}, partition=PRETRAIN_META))


def test_the_defaults_are_the_authors_recipe_and_its_rate_steps():
    """augfl.md 2.2 (train_teacher_model.py): SGD 0.05, momentum 0.9, weight decay 5e-4, batch 64, 240 epochs, the
    rate x0.1 from epochs 150, 180 and 210 (CRD's `epoch > lr_decay_epochs` with 1-based epochs)."""
    s = AugFlSettings()
    recipe = (s.teacher_lr, s.teacher_momentum, s.teacher_weight_decay, s.teacher_batch_size, s.teacher_epochs)
    assert recipe == (0.05, 0.9, 5e-4, 64, 240) and s.teacher_lr_steps == (150, 180, 210)
    request = TrainModel("mlp", np.zeros(0), np.zeros(0), np.zeros(1), 240, 0.05, 64, lr_steps=(150, 180, 210))
    rates = [request.lr_at(epoch) for epoch in (0, 149, 150, 179, 180, 210, 239)]
    np.testing.assert_allclose(rates, [0.05, 0.05, 0.005, 0.005, 0.0005, 0.00005, 0.00005])


def test_pretrain_writes_a_file_whose_header_and_checksum_verify(tmp_path):
    config = _config(teacher_lr_steps=[0], teacher_batch_size=32)
    path = pretrain(config, tmp_path / "teacher.npz")
    params, header = read_weights(path, "test")
    assert header.format_version == FORMAT_VERSION and header.sha256 == checksum(params)
    assert (header.model, header.dataset, header.classes, header.parameters) == (
        "mlp",
        "synthetic_classification",
        4,
        params.size,
    )
    assert header.torch == torch.__version__ and dict(header.layers)["1.weight"] == (128, 20)
    recipe = header.recipe
    assert (recipe["epochs"], recipe["lr"], recipe["batch_size"], recipe["lr_steps"]) == (1, 0.05, 32, [0])
    assert recipe["pool_samples"] == PRETRAIN_META["reserved"] and recipe["seed"] == config.seed
    assert np.isfinite(recipe["mean_loss"]) and not list(tmp_path.glob(".*"))  # no temporary file left


def test_a_run_loads_the_file_and_its_teacher_is_the_files(tmp_path):
    path = pretrain(_config(), tmp_path / "teacher.npz")
    params, _ = read_weights(path, "test")
    problem = prepare(_config(teacher_weights=str(path)))
    assert problem.server_data.pretrained_model == "mlp"
    assert problem.server_data.pretrained.tobytes() == params.tobytes()


def _rewrite(path, params, header):
    """The file with other parameters under its old header (or another header), as corruption would leave it."""
    with open(path, "wb") as file:
        np.savez(file, params=np.asarray(params, np.float32), header=np.array(json.dumps(header)))


def test_a_corrupted_or_mismatched_file_is_refused_in_one_line_naming_field_and_file(tmp_path):
    path = pretrain(_config(), tmp_path / "teacher.npz")
    params, header = read_weights(path, "test")
    with np.load(path) as stored:
        raw = json.loads(str(stored["header"]))
    refusals = {}
    corrupted = tmp_path / "corrupted.npz"
    _rewrite(corrupted, params + np.float32(1e-3) * (np.arange(params.size) == 7), raw)
    refusals[corrupted] = "corrupted: the parameters' sha256"
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not weights")
    refusals[garbage] = "not a raysim weights file"
    future = tmp_path / "future.npz"
    _rewrite(future, params, {**raw, "format_version": FORMAT_VERSION + 1})
    refusals[future] = f"weights format raysim-weights version {FORMAT_VERSION + 1}"
    refusals[tmp_path / "missing.npz"] = "no such file"
    for file, reason in refusals.items():
        with pytest.raises(ConfigError) as refused:
            prepare(_config(teacher_weights=str(file)))
        message = str(refused.value)
        assert message.startswith(f"algorithm.teacher_weights: {file}: {reason}") and "\n" not in message, message
    # a sound file of another architecture, or of other classes (another dataset)
    with pytest.raises(ConfigError, match=rf"^algorithm\.teacher_weights: {path} holds weights of model mlp, not mlr"):
        prepare(_config(teacher_weights=str(path), teacher_model="mlr"))
    generator = np.random.default_rng(0)
    np.savez(tmp_path / "three.npz", x=generator.normal(size=(900, 20)).astype(np.float32), y=np.arange(900) % 3)
    other = tiny_config(
        algorithm={**CRD, "teacher_epochs": 1},
        partition=PRETRAIN_META,
        dataset={"name": "npz", "path": str(tmp_path / "three.npz")},
    )
    elsewhere = pretrain(validate_config(other), tmp_path / "weights-of-three.npz")
    with pytest.raises(ConfigError, match=rf"^algorithm\.teacher_weights: {elsewhere} holds weights of 3 classes, "):
        prepare(_config(teacher_weights=str(elsewhere)))


def test_an_interrupted_write_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    path = pretrain(_config(), tmp_path / "teacher.npz")
    before = path.read_bytes()
    params, header = read_weights(path, "test")

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)  # Ctrl-C between the complete temporary file and the rename
    with pytest.raises(KeyboardInterrupt):
        write_weights(path, params * 2, header.__class__(**{**header.__dict__, "sha256": checksum(params * 2)}))
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
