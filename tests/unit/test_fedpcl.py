"""FedPCL (raysim.algorithms.fedpcl; Tan et al., NeurIPS 2022): the prototype-wise contrastive loss against a hand
computation, the global prototypes of one client equal to its local ones, the encoder frozen at the weights file's
parameters, nearest-prototype inference, only prototypes travelling, and the refusal of a run without an encoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms.fedpcl import FedPcl, PrototypeContrast
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.runtime import checkpoint
from raysim.runtime.problem import prepare
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess
from tests.support.weights import weights_file

SGD = {"lr": 0.5, "batch_size": 16, "epochs": 2}


def _config(count: int = 3, **algorithm):
    settings = {"name": "fedpcl", **SGD, **algorithm}
    return validate_config(tiny_config(algorithm=settings, model={"name": "mlp"}, clients={"count": count}))


def _encoder(tmp_path, count: int = 3):
    """A weights file of the clients' MLP: its parameters are the 'pretrained' encoder (any fixed values do)."""
    config = validate_config(tiny_config(algorithm={"name": "fedavg"}, model={"name": "mlp"}, clients={"count": count}))
    params = np.random.default_rng(3).normal(0, 0.3, size=prepare(config).init_params.size).astype(np.float32)
    return weights_file(tmp_path / "encoder.npz", config, params), params


def test_the_contrastive_loss_is_the_hand_computed_one():
    """Two prototype sets (global, one client's) on 3 classes of which 2 have prototypes, a batch of 3 samples one
    of which is of the class without a prototype: weights 1 and 1/m, softmax over the present classes, the mean over
    the samples whose class has one."""
    model = FlatModel("mlr", (2,), 3)
    theta = torch.tensor([1.0, 0.5, -0.5, 2.0, 0.0, 1.0, 0.1, -0.2, 0.3])  # W [3, 2] then b [3]
    x = torch.tensor([[1.0, 0.0], [0.5, -1.0], [2.0, 1.0]])
    y = torch.tensor([0, 2, 1])
    sets = np.array(
        [[[0.6, 0.8, 0.0], [0.0, 0.6, 0.8], [9.0, 9.0, 9.0]], [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]],
        np.float32,
    )
    loss = PrototypeContrast(sets, np.array([True, True, False]), np.array([1.0, 0.5]), temperature=0.5)
    value, grad = loss.loss_and_grad(model, theta, x, y, None)
    w, b = theta[:6].numpy().reshape(3, 2), theta[6:].numpy()
    expected = 0.0
    for s, weight in enumerate((1.0, 0.5)):
        terms = []
        for sample in (0, 2):  # the class-2 sample has no prototype
            h = w @ x[sample].numpy() + b
            z = h / np.linalg.norm(h)
            logits = np.array([z @ sets[s, j] for j in (0, 1)]) / 0.5
            terms.append(-(logits[y[sample].item()] - np.log(np.exp(logits).sum())))
        expected += weight * np.mean(terms)
    assert value == pytest.approx(expected, rel=1e-5)
    assert grad.shape == theta.shape and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_with_one_client_the_global_prototypes_are_its_local_ones_and_the_encoder_stays_frozen(tmp_path):
    path, encoder = _encoder(tmp_path, count=1)
    sim = InProcess(_config(1, teacher_weights=str(path)))
    algorithm: FedPcl = sim.coordinator.algorithm
    body = ~algorithm.head_mask
    heads = []
    for round_index in range(3):
        sim.round(round_index)
        state = sim.states[0]
        server = sim.coordinator.state.prototypes
        held = state.held
        assert held.any() and np.array_equal(server.present, held)
        np.testing.assert_allclose(server.prototypes[held], state.prototypes[held], rtol=1e-6)
        np.testing.assert_array_equal(server.local[0], state.prototypes)
        np.testing.assert_array_equal(state.theta[body], encoder[body])  # the pretrained encoder, never trained
        heads.append(state.theta[algorithm.head_mask].copy())
    assert np.array_equal(heads[0], sim.problem.init_params[algorithm.head_mask])  # round 0: no prototype to learn on
    assert not np.array_equal(heads[1], heads[2])  # then the projection learns
    x, labels = sim.host.data[0].arrays("train")
    z = torch.nn.functional.normalize(sim.host.model.forward(torch.from_numpy(state.theta), torch.from_numpy(x)), dim=1)
    for j in np.flatnonzero(held):  # the prototype is the mean normalized embedding of the class
        np.testing.assert_allclose(state.prototypes[j], z[labels == j].mean(0).numpy(), atol=1e-5)


def test_the_personalized_model_is_nearest_local_prototype_inference(tmp_path):
    path, _ = _encoder(tmp_path)
    sim = InProcess(_config(teacher_weights=str(path)))
    for round_index in range(2):
        sim.round(round_index)
    algorithm: FedPcl = sim.coordinator.algorithm
    for client, state in sim.states.items():
        if not state.held.any():
            continue
        x = torch.from_numpy(sim.host.data[client].arrays("test")[0])
        model = sim.host.model
        z = torch.nn.functional.normalize(model.forward(torch.from_numpy(state.theta), x), dim=1).numpy()
        similarity = np.where(state.held, z @ state.prototypes.T, -np.inf)
        logits = model.forward(torch.from_numpy(algorithm.personalized_model(state)), x).numpy()
        np.testing.assert_array_equal(logits.argmax(1), similarity.argmax(1))
    # the persistent state (clients' projections and prototypes, the server's prototype tables) survives a checkpoint
    tree = {"clients": dict(sim.states), "server": sim.coordinator.state}
    checkpoint.save_tree(tmp_path / "state.npz", tree)
    back = checkpoint.load_tree(tmp_path / "state.npz")
    for client, state in sim.states.items():
        restored = back["clients"][client]
        assert type(restored) is type(state)
        for name in ("theta", "prototypes", "held"):
            assert getattr(restored, name).tobytes() == getattr(state, name).tobytes()
    assert back["server"].prototypes.local.tobytes() == sim.coordinator.state.prototypes.local.tobytes()


def test_only_prototypes_travel(tmp_path):
    """Uplink: the prototype and count of each held class; downlink: the global and every client's local prototypes;
    no model parameter, whatever the model's size."""
    path, _ = _encoder(tmp_path)
    sim = InProcess(_config(teacher_weights=str(path)))
    algorithm: FedPcl = sim.coordinator.algorithm
    metrics = sim.round(0)
    d = algorithm.dim
    state = sim.states[0]
    held = int(state.held.sum())
    assert algorithm.uplink_bytes(_upload_of(algorithm, state)) == 4 * held * (d + 1)
    broadcast = sim.coordinator.state.prototypes
    assert algorithm.downlink_bytes(broadcast) == 4 * d * (int(broadcast.present.sum()) + int(broadcast.held.sum()))
    assert algorithm.downlink_bytes(broadcast) < 4 * sim.problem.init_params.size / 10
    assert metrics["prototype_classes"] == broadcast.present.sum()


def _upload_of(algorithm: FedPcl, state):
    from raysim.algorithms.fedpcl import FedPclUpload

    weight = np.where(state.held, 1.0, 0.0)
    return FedPclUpload(weight[:, None] * state.prototypes, weight, np.zeros((1,)), np.zeros((1,)))


def test_a_run_without_an_encoder_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as refused:
        prepare(_config())
    message = str(refused.value)
    assert message.startswith("partition.scheme=dirichlet: FedPCL needs a frozen pretrained encoder") and "\n" not in (
        message
    )
    assert "algorithm.teacher_weights" in message
