"""FedRoD (raysim.algorithms.fedrod): the balanced softmax, the personal head on the detached generic logits, the
special case that coincides with FedAvg, the PM's head, and its communication accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms.fedrod import TwoHeadLoss, class_prior_shift
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from tests.support.experiments import tiny_config
from tests.support.features import CLASSES, DIM, labelled_problem
from tests.support.inprocess import InProcess


def _batch(seed: int = 0) -> tuple[FlatModel, torch.Tensor, torch.Tensor, torch.Tensor]:
    source = np.random.default_rng(seed)
    model = FlatModel("mlp", (DIM,), CLASSES)
    x = torch.from_numpy(source.normal(size=(10, DIM)).astype(np.float32))
    y = torch.from_numpy(np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 2]))
    return model, torch.from_numpy(model.initial_parameters(seed)), x, y


def _with_head(model: FlatModel, point: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
    """The vector TwoHeadLoss trains: the model's parameters, then a personal head (zeros unless given)."""
    return torch.cat([point, torch.zeros(model.spec.head_size) if head is None else head])


def test_balanced_softmax_with_a_uniform_prior_is_cross_entropy():
    """CE(logits + log n) with every n_c equal adds one constant to every logit: plain CE, value and gradient (the
    personal head's term alike in both)."""
    model, point, x, y = _batch()
    plain_loss, plain_grad = TwoHeadLoss(None).loss_and_grad(model, _with_head(model, point), x, y, None)
    shift = class_prior_shift(np.full(CLASSES, 7.0))
    loss, grad = TwoHeadLoss(shift).loss_and_grad(model, _with_head(model, point), x, y, None)
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=0)
    _plain, alone = model.loss_and_grad(point, x, y)  # the model's part: plain CE's gradient
    torch.testing.assert_close(grad[: model.size], alone, atol=1e-6, rtol=0)


def test_balanced_softmax_adds_the_log_class_counts():
    """A skewed prior: the loss is CE of logits + log n_c, an absent class's logit at -inf (probability 0)."""
    model, point, x, y = _batch(1)
    counts = np.array([6.0, 3.0, 0.0])
    shift = class_prior_shift(counts)
    assert shift is not None and shift[2] == -np.inf
    loss, grad = TwoHeadLoss(shift).loss_and_grad(model, _with_head(model, point), x[:9], y[:9], None)  # classes 0, 1
    with torch.no_grad():
        _z, logits = model.features(point, x[:9])
    adjusted = logits[:, :2] + torch.log(torch.tensor([6.0, 3.0]))
    personal = torch.nn.functional.cross_entropy(logits, y[:9])  # a zero personal head adds nothing to the logits
    expected = torch.nn.functional.cross_entropy(adjusted, y[:9]) + personal
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert torch.isfinite(grad).all()
    assert class_prior_shift(np.zeros(CLASSES)) is None and class_prior_shift(np.zeros(0)) is None


def test_the_personal_head_learns_on_detached_logits_and_features():
    """With a second head the model's gradient is that of its own loss alone (nothing flows back from the personal
    head), and the personal head's is the gradient of CE(generic logits + W2 z + b2) in (W2, b2) at fixed z."""
    model, point, x, y = _batch(2)
    head = torch.from_numpy(np.random.default_rng(3).normal(size=model.spec.head_size).astype(np.float32))
    shift = class_prior_shift(np.array([6.0, 3.0, 1.0]))
    _two, both = TwoHeadLoss(shift).loss_and_grad(model, _with_head(model, point, head), x, y, None)
    leaf = point.clone().requires_grad_(True)
    _z, own_logits = model.features(leaf, x)
    torch.nn.functional.cross_entropy(own_logits + torch.from_numpy(shift), y).backward()
    assert leaf.grad is not None
    torch.testing.assert_close(both[: model.size], leaf.grad, atol=1e-7, rtol=0)
    with torch.no_grad():
        z, logits = model.features(point, x)
    weight = head[: CLASSES * 64].reshape(CLASSES, 64).clone().requires_grad_(True)
    bias = head[CLASSES * 64 :].clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(logits + z @ weight.T + bias, y).backward()
    assert weight.grad is not None and bias.grad is not None
    torch.testing.assert_close(both[model.size :], torch.cat([weight.grad.reshape(-1), bias.grad]), atol=1e-6, rtol=0)


def _run(name: str, problem, rounds: int, **settings) -> InProcess:
    algorithm = {"name": name, "lr": 0.1, "batch_size": 8, "epochs": 2, **settings}
    config = validate_config(
        tiny_config(algorithm=algorithm, clients={"count": len(problem.clients)}, model={"name": "mlp"})
    )
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim


@pytest.mark.parametrize("generic_loss", ["balanced_softmax", "ce"])
def test_with_a_uniform_prior_its_global_model_is_fedavgs(generic_loss):
    """Clients holding every class equally: the balanced softmax is CE and the personal head never reaches the body
    or generic head, so the GM is FedAvg's (same batches, same steps), whatever the personal heads learn."""
    problem = labelled_problem(3, 6, seed=4)
    rod, avg = _run("fedrod", problem, 2, generic_loss=generic_loss), _run("fedavg", problem, 2)
    np.testing.assert_allclose(rod.server.w, avg.server.w, atol=1e-6)
    assert np.abs(rod.server.w - problem.init_params).max() > 1e-3
    assert all(np.abs(state.personal_head).max() > 1e-4 for state in rod.states.values())


def test_skewed_clients_differ_from_fedavg():
    problem = labelled_problem(2, 6, seed=5, held=[[0, 0, 0, 1], [1, 2]])
    rod, avg = _run("fedrod", problem, 1), _run("fedavg", problem, 1)
    assert np.abs(rod.server.w - avg.server.w).max() > 1e-4


def test_pm_is_the_network_with_the_summed_heads():
    """PM = body + (g_G + g_P): its logits are the generic logits plus the personal head's on the same features;
    at a zero personal head (before training) PM = GM."""
    problem = labelled_problem(2, 4, seed=6)
    sim = _run("fedrod", problem, 1)
    algorithm, gm = sim.coordinator.algorithm, sim.server.w
    state = sim.states[0]
    pm = algorithm.evaluated_model(state, gm)
    model = problem.model_spec.build()
    x = torch.from_numpy(problem.x[:5])
    with torch.no_grad():
        z, generic = model.features(torch.from_numpy(gm), x)
        weight, bias = model.spec_head(torch.from_numpy(state.personal_head))
        expected = generic + z @ weight.T + bias
    np.testing.assert_allclose(model.predict(pm, problem.x[:5]), expected.numpy(), atol=1e-5)
    zero = algorithm.init_client(problem.clients[0][0], problem.init_params)
    np.testing.assert_array_equal(algorithm.evaluated_model(zero, gm), gm)


def test_communication_is_body_and_generic_head():
    """Uplink and downlink: the body and generic head (the model's size) and the upload's weight; the personal
    head (the head's size) stays on the client."""
    problem = labelled_problem(2, 4, seed=7)
    sim = _run("fedrod", problem, 1)
    algorithm = sim.coordinator.algorithm
    size = problem.params.size
    update = algorithm.Upload(np.zeros(size), 1.0)
    assert algorithm.uplink_bytes(update) == 4 * (size + 1)
    assert algorithm.downlink_bytes(algorithm.broadcast(sim.server)) == 4 * size
    assert sim.states[0].personal_head.size == problem.params.head_size == CLASSES * (64 + 1)


@pytest.mark.parametrize(("key", "value"), [("generic_loss", "focal"), ("aggregation", "median")])
def test_invalid_settings_are_refused_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}"):
        validate_config(tiny_config(algorithm={"name": "fedrod", key: value}))


def test_class_counts_draw_nothing_and_follow_redrawn_labels():
    """The counts alone read the stored labels (no generator); a client whose labels are redrawn uniformly from r
    classes (label poisoning) gets their expected counts n / r, so no label it trains on has a zero prior."""
    from raysim.algorithms.requests import ClassMeans, draws_randomness
    from raysim.training.local import ClientData, LocalTrainer

    model = FlatModel("mlp", (DIM,), CLASSES)
    y = np.array([0, 0, 1, 1, 1, 0], np.int64)
    empty = np.array([], np.int64)
    data = ClientData(np.zeros((6, DIM), np.float32), y, np.arange(6), empty, empty)
    request = ClassMeans(None)
    assert not draws_randomness(request) and draws_randomness(ClassMeans(model.initial_parameters(0)))
    assert LocalTrainer(model).run(request, data, None).counts.tolist() == [3.0, 3.0, 0.0]
    poisoned = ClientData(data.x, y, data.train, empty, empty, random_labels=CLASSES)
    assert LocalTrainer(model).run(request, poisoned, None).counts.tolist() == [2.0, 2.0, 2.0]


def test_the_lockstep_executor_runs_a_feature_loss_one_client_at_a_time():
    """VectorizedTrainer.sgd trains each TwoHeadLoss request alone (its own prior and second head), with the result
    of LocalTrainer.sgd bit for bit, next to plain requests that it stacks."""
    from raysim.algorithms.fedrod import FedRoDSettings
    from raysim.training.local import ClientData, LocalTrainer
    from raysim.training.vectorized import VectorizedTrainer

    model, point, x, y = _batch(8)
    empty = np.array([], np.int64)
    data = ClientData(x.numpy(), y.numpy(), np.arange(len(y)), empty, empty)
    settings = FedRoDSettings(lr=0.1, batch_size=4, epochs=2)
    start = np.concatenate([point.numpy(), np.zeros(model.spec.head_size, np.float32)])
    requests = [
        settings.local_sgd(start, terms=(TwoHeadLoss(class_prior_shift(np.array([6.0, 3.0, 1.0]))),)),
        settings.local_sgd(point.numpy()),
        settings.local_sgd(start, terms=(TwoHeadLoss(None),)),
    ]
    lockstep = VectorizedTrainer(model, 4).sgd([(r, data, np.random.default_rng(i)) for i, r in enumerate(requests)])
    for i, request in enumerate(requests):
        alone = LocalTrainer(model).sgd(request, data, np.random.default_rng(i))
        if request.terms:
            np.testing.assert_array_equal(lockstep[i].params, alone.params)
        else:
            np.testing.assert_allclose(lockstep[i].params, alone.params, atol=1e-6)
    assert np.abs(lockstep[0].params - lockstep[2].params).max() > 1e-4
