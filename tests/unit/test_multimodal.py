"""Multimodal samples (raysim.data.modalities), FedAPM's three multimodal models (raysim.models.multimodal) and the
offline substitutes (raysim.data.substitutes), up to a FedAPM run on a real local Ray (issue 31)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from raysim.algorithms.requests import LocalSGD
from raysim.config import validate_config
from raysim.data import Dataset
from raysim.data.modalities import Modalities, Modality
from raysim.data.sources import load_dataset
from raysim.errors import ConfigError, DataError
from raysim.models.flat import FlatModel, ModelSpec
from raysim.models.zoo import build_module
from raysim.runtime.problem import prepare
from raysim.training.local import ClientData, Inputs, LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.data_files import SMALL_CRISIS
from tests.support.experiments import tiny_config

CRISISMMD = Modalities([Modality("image", (1, 1280)), Modality("text", (32, 512), sequence=True)])


KUHAR = Modalities([Modality("acc", (256, 3)), Modality("gyro", (256, 3))])


CREMAD = Modalities([Modality("audio", (600, 80), sequence=True), Modality("video", (6, 1280))])


@pytest.mark.parametrize(
    ("model", "modalities", "classes", "total", "personal_tensors", "personal"),
    [
        ("image_text_classifier", CRISISMMD, 8, 545_870, 8, 427_008),
        ("har_classifier", KUHAR, 8, 420_814, 12, 103_808),
        ("mm_action_classifier", CREMAD, 4, 823_338, 14, 704_736),
    ],
)
def test_parameter_counts_are_the_specs(model, modalities, classes, total, personal_tensors, personal):
    """fedapm.md 2: totals, and the first `layer_num` tensors (the code's personal part) hold the personal count."""
    module = build_module(model, modalities, classes)
    params = list(module.parameters())
    assert sum(p.numel() for p in params) == total
    assert sum(p.numel() for p in params[:personal_tensors]) == personal


def test_paper_sizes_differ_from_the_codes_only_for_image_text():
    paper = build_module("image_text_classifier_paper", CRISISMMD, 8)
    assert sum(p.numel() for p in paper.parameters()) == (1280 * 64 + 64) + 3 * (512 * 64 + 64 * 64 + 128) + (
        64 * 512 + 512 + 512 * 4 + 4
    ) + (256 * 64 + 64 + 64 * 8 + 8)


def test_packed_rows_round_trip_and_zero_the_padding():
    shape = Modalities([Modality("image", (1, 3)), Modality("text", (4, 2), sequence=True)])
    assert tuple(shape) == (3 + 8 + 1,) and shape.length_columns == (11,)
    generator = np.random.default_rng(0)
    image, text = generator.normal(size=(5, 1, 3)), generator.normal(size=(5, 4, 2))
    lengths = np.array([1, 4, 2, 3, 4])
    rows = shape.pack({"image": image, "text": text}, {"text": lengths})
    values, read = shape.unpack(rows)
    np.testing.assert_allclose(values["image"], image.astype(np.float32))
    np.testing.assert_array_equal(read["text"], lengths)
    for row, length in enumerate(lengths):
        np.testing.assert_allclose(values["text"][row, :length], text[row, :length].astype(np.float32))
        assert not values["text"][row, length:].any()
    assert pickle.loads(pickle.dumps(shape)) == shape and pickle.loads(pickle.dumps(shape)).parts == shape.parts
    plain = (12,)
    assert shape != plain and plain != shape  # a packed shape is not a plain one of the same width
    with pytest.raises(DataError, match="text: 5 lengths in 1..4"):
        shape.pack({"image": image, "text": text}, {"text": lengths + 1})


def test_a_dataset_refuses_rows_that_do_not_fit_its_modalities():
    shape = Modalities([Modality("a", (2,)), Modality("b", (3, 2), sequence=True)])
    with pytest.raises(DataError, match=r"packed as float32 rows \(n, 9\)"):
        Dataset("bad", np.zeros((4, 8), np.float32), np.zeros(4, np.int64), 2, modalities=shape)


def test_outputs_do_not_depend_on_what_lies_beyond_a_sequences_length():
    """The GRU runs over the real tokens only and the attention masks the rest: rewriting the padding (not the
    length column) changes no output."""
    data = load_dataset(**SMALL_CRISIS)
    model = FlatModel("image_text_classifier", data.input_shape, data.num_classes)
    params = model.initial_parameters(0)
    rows = data.x[:20].copy()
    columns, length_column = data.modalities.columns("text"), data.modalities.length_column("text")
    text = rows[:, columns].reshape(20, 6, 8)
    lengths = rows[:, length_column].astype(int)
    assert lengths.min() < 6  # some padding to rewrite
    for row, length in enumerate(lengths):
        text[row, length:] = 100.0
    rows[:, columns] = text.reshape(20, -1)
    np.testing.assert_allclose(model.predict(params, rows), model.predict(params, data.x[:20]), rtol=1e-5, atol=1e-6)
    shorter = data.x[:20].copy()
    shorter[:, length_column] = 1  # fewer real tokens: the outputs do change
    assert not np.allclose(model.predict(params, shorter), model.predict(params, data.x[:20]))


def test_feature_noise_leaves_the_length_columns_alone():
    data = load_dataset(**SMALL_CRISIS)
    lengths = data.modalities.length_columns
    client = ClientData(
        data.x, data.y, np.arange(30), np.arange(0), np.arange(0), noise_std=0.5, inputs=Inputs(lengths=lengths)
    )
    x, _ = client.batch(np.arange(30), np.random.default_rng(1))
    np.testing.assert_array_equal(x[:, list(lengths)], data.x[:30, list(lengths)])
    others = np.setdiff1d(np.arange(data.x.shape[1]), lengths)
    assert (x[:, others] != data.x[:30][:, others]).mean() > 0.99


def test_dropout_masks_come_from_the_clients_stream_and_evaluation_has_none():
    data = load_dataset(**SMALL_CRISIS)
    model = FlatModel("image_text_classifier", data.input_shape, data.num_classes)
    assert model.stochastic and not FlatModel("mlp", (4,), 2).stochastic
    params = torch.from_numpy(model.initial_parameters(0))
    x, y = torch.from_numpy(data.x[:16]), torch.from_numpy(data.y[:16])
    same = [model.loss_and_grad(params, x, y, 5)[0] for _ in range(2)]
    other, off = model.loss_and_grad(params, x, y, 6)[0], model.loss_and_grad(params, x, y)[0]
    assert same[0] == same[1] and len({same[0], other, off}) == 3
    flat = params.numpy()
    np.testing.assert_array_equal(model.predict(flat, data.x[:16]), model.predict(flat, data.x[:16]))
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    model.loss_and_grad(params, x, y, 5)
    assert torch.rand(1) == before  # torch's global generator is left where it was


def test_sgd_on_a_multimodal_client_is_reproducible_and_learns():
    data = load_dataset(**{**SMALL_CRISIS, "image_signal": 2.0})
    model = FlatModel("image_text_classifier", data.input_shape, data.num_classes)
    client = ClientData(data.x, data.y, np.arange(100), np.arange(100, 120), np.arange(0))

    request = LocalSGD(model.initial_parameters(0), epochs=8, lr=0.2, batch_size=20)
    first, second = (LocalTrainer(model).sgd(request, client, np.random.default_rng(3)) for _ in range(2))
    np.testing.assert_array_equal(first.params, second.params)
    start = model.loss_and_grad(
        torch.from_numpy(request.start), torch.from_numpy(data.x[:100]), torch.from_numpy(data.y[:100])
    )[0]
    end = model.loss_and_grad(
        torch.from_numpy(first.params), torch.from_numpy(data.x[:100]), torch.from_numpy(data.y[:100])
    )[0]
    assert end < 0.7 * start


def test_the_vectorized_trainer_trains_multimodal_clients_one_at_a_time_with_their_own_masks():
    """Stacking does not pay for these models (docs/performance.md) and their dropout masks come from each
    client's stream: the vectorized executor falls back to LocalTrainer, client for client bit for bit."""
    data = load_dataset(**SMALL_CRISIS)
    model = FlatModel("image_text_classifier", data.input_shape, data.num_classes)
    trainer = VectorizedTrainer(model, chunk=2)
    assert trainer.mode == "sequential" and "dropout" in (trainer.unavailable or "")
    spans = [(0, 30), (30, 45), (45, 90)]
    clients = [ClientData(data.x, data.y, np.arange(a, b), np.arange(0), np.arange(0)) for a, b in spans]
    requests = [LocalSGD(model.initial_parameters(seed), epochs=2, lr=0.1, batch_size=20) for seed in range(3)]
    pairs = list(zip(requests, clients, strict=True))
    got = trainer.sgd([(request, client, np.random.default_rng(i)) for i, (request, client) in enumerate(pairs)])
    for i, (request, client) in enumerate(pairs):
        want = LocalTrainer(model).sgd(request, client, np.random.default_rng(i))
        np.testing.assert_array_equal(got[i].params, want.params)
        assert got[i].mean_loss == want.mean_loss and got[i].steps == want.steps


@pytest.mark.parametrize("name", ["crisismmd_synthetic", "kuhar_synthetic", "cremad_synthetic"])
def test_substitutes_have_the_papers_shapes_and_are_seeded(name):
    data = load_dataset(name, 3, samples=40)
    again, other = load_dataset(name, 3, samples=40), load_dataset(name, 4, samples=40)
    expected = {"crisismmd_synthetic": CRISISMMD, "kuhar_synthetic": KUHAR, "cremad_synthetic": CREMAD}[name]
    assert data.input_shape == expected and data.x.shape == (40, expected[0])
    assert data.groups is not None and len(np.unique(data.groups)) > 1
    np.testing.assert_array_equal(data.x, again.x)
    assert not np.array_equal(data.x, other.x)
    spec = ModelSpec(
        {
            "crisismmd_synthetic": "image_text_classifier",
            "kuhar_synthetic": "har_classifier",
            "cremad_synthetic": "mm_action_classifier",
        }[name],
        data.input_shape,
        data.output_dim,
        data.task,
    )
    outputs = spec.build().predict(spec.build().initial_parameters(0), data.x[:3])
    assert outputs.shape == (3, data.num_classes) and np.isfinite(outputs).all()


def test_a_multimodal_model_on_other_data_is_refused_with_one_line():
    config = validate_config(tiny_config(model={"name": "image_text_classifier"}))
    with pytest.raises(ConfigError) as refused:
        prepare(config)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.name=image_text_classifier needs a dataset with")
    assert "crisismmd_synthetic" in message
