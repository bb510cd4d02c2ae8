"""AugFL's mathematics (augfl.md 1.6-1.8) on the real host/coordinator code: the finite-difference Hessian-vector
product, the dual identity y_i = -w_i d_i, the closed-form global recursion, the stationary point regularized by
the teacher, the teacher's settings and their old `pm_*` names, and a CLI run."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import yaml

from raysim.algorithms.requests import FullGradient
from raysim.config import validate_config
from raysim.evaluation.batched import Scorer
from tests.support.augfl import META
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess
from tests.support.weights import weights_file


def _sim(partition: dict | None = None, **algorithm) -> InProcess:
    settings = {"name": "augfl", "alpha": 0.1, "rho": 0.7, "lambda": 0.0, "query_split": "val", **algorithm}
    partition = partition or {"scheme": "dirichlet", "beta": 0.5, "val_fraction": 0.5}
    return InProcess(validate_config(tiny_config(algorithm=settings, partition=partition, rounds=3)))


def _gradient(sim: InProcess, client: int, point: np.ndarray, split: str) -> np.ndarray:
    data = sim.host.data[client]
    return sim.host.steps.executor.trainer.full_gradient(
        FullGradient(point.astype(np.float32), split), data, None
    ).grad.astype(np.float64)


def _meta_gradient(sim: InProcess, client: int, theta: np.ndarray, k: int) -> np.ndarray:
    """d_i = grad L(phi, D^q) - alpha g_i (eqs. 7, 10), recomputed outside the algorithm."""
    algorithm = sim.host.algorithm
    alpha, delta = algorithm.settings.alpha, algorithm.delta(k)
    r = _gradient(sim, client, theta - alpha * _gradient(sim, client, theta, "train"), "val")
    g = (_gradient(sim, client, theta + delta * r, "train") - _gradient(sim, client, theta - delta * r, "train")) / (
        2 * delta
    )
    return r - alpha * g


def test_finite_difference_hessian_product_converges_to_autodiff():
    """Eq. 10's g -> Hess L(theta, D^s) r as delta -> 0, with an O(delta^2) error (central differences)."""
    sim = _sim()
    model, data = sim.host.model, sim.host.data[0]
    theta = torch.from_numpy(sim.problem.init_params.astype(np.float64)) + 0.3
    x, y = (torch.from_numpy(a) for a in data.arrays("train"))
    r = torch.randn(theta.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r /= torch.linalg.norm(r)

    def loss(flat):
        return model._loss(model.forward(flat.float(), x), y).double()

    exact = torch.autograd.functional.hvp(loss, theta, r)[1].numpy()
    errors = []
    for delta in (1.0, 0.3, 0.1):
        g = (
            _gradient(sim, 0, theta.numpy() + delta * r.numpy(), "train")
            - _gradient(sim, 0, theta.numpy() - delta * r.numpy(), "train")
        ) / (2 * delta)
        errors.append(np.linalg.norm(g - exact) / np.linalg.norm(exact))
    assert errors[2] < 5e-3 and errors[0] / errors[1] > 6 and errors[1] / errors[2] > 6, errors  # ~ (1/0.3)^2


def test_dual_is_minus_the_weighted_meta_gradient_and_primal_is_the_dual_change():
    """augfl.md 1.8(a)/(b) after every participation: y_i = -w_i d_i(theta^t), theta_i - theta^t = (y_i - y_prev)/rho,
    under partial participation (unselected clients keep their state)."""
    sim = _sim()
    rho = 0.7
    for round_index, selected in enumerate(([0, 1, 2, 3], [1, 3], [0, 2, 3])):
        theta = sim.coordinator.broadcast().astype(np.float64)
        before = {c: (s.y.copy(), s.participations) for c, s in sim.states.items()}
        sim.round(round_index, selected)
        for client, state in sim.states.items():
            if client not in selected:
                assert state.participations == before[client][1]
                continue
            weight = sim.host.info[client].weight
            d = _meta_gradient(sim, client, theta, state.participations)
            np.testing.assert_allclose(state.y, -weight * d, atol=2e-5)
            np.testing.assert_allclose(state.theta - theta, (state.y - before[client][0]) / rho, atol=2e-5)


def test_full_participation_follows_the_extrapolated_gradient_recursion():
    """augfl.md 1.8(c) with lambda = 0: theta^{t+1} = theta^t - sum_i w_i (2 d_i^t - d_i^{t-1}) / (m rho), and
    theta^1 = theta^0 - 2 sum_i w_i d_i^0 / (m rho) from y^{-1} = 0."""
    sim = _sim()
    m, rho = 4, 0.7
    previous = None
    for round_index in range(4):
        theta = sim.coordinator.broadcast().astype(np.float64)
        d = {c: _meta_gradient(sim, c, theta, round_index + 1) for c in range(m)}
        weights = {c: sim.host.info[c].weight for c in range(m)}
        step = sum(weights[c] * (2 * d[c] - (0 if previous is None else previous[c])) for c in range(m))
        sim.round(round_index, list(range(m)))
        np.testing.assert_allclose(sim.coordinator.broadcast(), theta - step / (m * rho), atol=2e-5)
        previous = d


def test_teacher_regularizer_reaches_the_stationary_point_of_the_regularized_objective(tmp_path):
    """With R_h = ||theta - theta_p||^2 the fixed point of eq. 13 solves sum_i w_i d_i(theta) + 2 lambda (theta -
    theta_p) = 0 (estimated grad F of eq. 2 plus the regularizer); a larger lambda pulls theta closer to theta_p."""
    reference = _sim(META)
    theta_p = np.random.default_rng(1).normal(0, 0.5, size=reference.problem.init_params.size).astype(np.float32)
    path = weights_file(tmp_path / "teacher.npz", reference.config, theta_p)
    distances = {}
    for lam in (0.5, 1.0):
        sim = _sim(META, regularizer="l2", teacher_weights=str(path), rho=5.0, **{"lambda": lam})  # 1/(m rho) stable
        for round_index in range(200):
            sim.round(round_index, [0, 1, 2, 3])
        theta = sim.coordinator.broadcast().astype(np.float64)
        k = sim.states[0].participations
        gradient = sum(sim.host.info[c].weight * _meta_gradient(sim, c, theta, k) for c in range(4))
        residual = gradient + 2 * lam * (theta - theta_p)
        assert np.linalg.norm(residual) < 1e-3 * np.linalg.norm(gradient)
        distances[lam] = np.linalg.norm(theta - theta_p)
    assert distances[1.0] < distances[0.5]
    assert sim.coordinator.algorithm._teacher is not None and sim.host.algorithm._teacher is None  # on the server only


def test_meta_partition_gives_two_class_few_shot_clients_disjoint_from_the_reserved_pools():
    from raysim.data.meta_partition import reserved_indices, server_indices
    from raysim.runtime.problem import prepare

    partition = {"scheme": "meta", "shots": 10, "reserved": 500, "server_samples": 300}
    config = validate_config(tiny_config(partition=partition, clients={"count": 20}))
    problem = prepare(config)
    reserved = reserved_indices(len(problem.y), config.partition, config.seed)
    held = [np.concatenate([split.train, split.test, split.val]) for _, split in problem.clients]
    everything = np.concatenate(held)
    server = server_indices(len(problem.y), config.partition, config.seed)
    assert len(reserved) == 500 and len(server) == 300 and len(np.unique(everything)) == len(everything)
    assert not np.intersect1d(everything, reserved).size and not np.intersect1d(everything, server).size
    assert not np.intersect1d(reserved, server).size  # the pretraining pool and D_s are disjoint too
    for (_, split), indices in zip(problem.clients, held, strict=True):
        assert 10 <= len(indices) <= 20 and len(np.unique(problem.y[indices])) == 2
        assert abs(len(split.train) - len(split.test)) <= 1  # support / query 50/50


def test_all_splits_weighting_is_the_authors_w_i():
    """The authors' w_i = (|D_i^s| + |D_i^q|) / sum_j (|D_j^s| + |D_j^q|) over the training clients (ServerMain's
    set_clients; `clients.weighting: all_splits`), where `samples` counts the support (train) split alone."""
    from raysim.runtime.problem import prepare

    partition = {"scheme": "meta", "shots": 10, "reserved": 500, "server_samples": 300}
    weights = {}
    for weighting in ("samples", "all_splits"):
        clients = {"count": 20, "heldout": 0.25, "weighting": weighting}
        problem = prepare(validate_config(tiny_config(partition=partition, clients=clients)))
        weights[weighting] = np.array([info.weight for info, _ in problem.clients])
        splits = [split for _, split in problem.clients]
    sizes = np.array([len(s.train) + len(s.test) for s in splits])
    assert sizes.sum() == sum(s.num_samples for s in splits)  # the meta partition has no val split: D^s and D^q
    np.testing.assert_allclose(weights["all_splits"][:15], sizes[:15] / sizes[:15].sum(), rtol=1e-12)
    assert not weights["all_splits"][15:].any() and weights["all_splits"].sum() == pytest.approx(1.0)
    train = np.array([len(s.train) for s in splits[:15]])
    np.testing.assert_allclose(weights["samples"][:15], train / train.sum(), rtol=1e-12)
    assert not np.allclose(weights["samples"], weights["all_splits"])  # odd sizes split unevenly: they differ


def test_pretrained_teacher_fits_the_reserved_pool_and_is_cached(tmp_path, monkeypatch):
    from raysim.data.meta_partition import reserved_indices
    from raysim.launch import pretrain
    from raysim.models.weights import read_weights
    from raysim.runtime.problem import prepare

    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    partition = {"scheme": "meta", "shots": 10, "reserved": 500, "server_samples": 300}
    algorithm = {"name": "augfl", "regularizer": "l2", "teacher_epochs": 3, "teacher_lr": 0.1}
    config = validate_config(tiny_config(algorithm=algorithm, partition=partition))
    path = pretrain(config)
    created = os.stat(path).st_mtime_ns
    assert pretrain(config) == path and os.stat(path).st_mtime_ns == created  # the cached file, reused
    problem = prepare(config)
    pool = reserved_indices(len(problem.y), config.partition, config.seed)
    model = Scorer(problem.model_spec.build())
    teacher_loss, teacher_acc = model.evaluate(read_weights(path, "test")[0], problem.x[pool], problem.y[pool])
    init_loss, _ = model.evaluate(problem.init_params, problem.x[pool], problem.y[pool])
    assert teacher_loss < 0.8 * init_loss and teacher_acc > 0.5


def test_heldout_clients_never_train_and_are_scored_one_step_from_the_current_global_model():
    """augfl.md 2.3: target clients (clients.heldout) take no part in training; at evaluation each takes one
    step from theta^t on its support set and is scored on its query set; summaries go to heldout/..."""
    from raysim.evaluation.columns import client_evaluations
    from raysim.evaluation.summaries import benign_summary

    config = validate_config(
        tiny_config(
            algorithm={"name": "augfl", "alpha": 0.1, "rho": 0.7, "lambda": 0.0},
            partition={**META, "val_fraction": 0.0},
            clients={"count": 10, "heldout": 0.2},
        )
    )
    sim = InProcess(config)
    assert sim.problem.num_training == 8 and sim.problem.heldout == {8, 9}
    initial = {c: sim.states[c] for c in (8, 9)}
    for round_index in range(3):
        sim.round(round_index)
    for c in (8, 9):  # untouched: the same values (client_states gives copies)
        for field in dataclasses.fields(initial[c]):
            now, then = getattr(sim.states[c], field.name), getattr(initial[c], field.name)
            assert np.array_equal(now, then, equal_nan=True), (c, field)
        assert sim.states[c].participations == 0
    theta = sim.coordinator.global_model()
    table = sim.host.evaluate(theta)
    evaluations = {e.client_id: e for e in client_evaluations(table)}
    model = Scorer(sim.host.model)
    for client in (8, 9):
        data = sim.host.data[client]
        phi = theta.astype(np.float64) - 0.1 * _gradient(sim, client, theta, "train")  # one step on D^s
        loss, accuracy = model.evaluate(phi.astype(np.float32), *data.arrays("test"))
        assert evaluations[client].pm.test_acc == accuracy and evaluations[client].pm.test_loss == pytest.approx(loss)
        assert evaluations[client].gm.test_acc == model.evaluate(theta, *data.arrays("test"))[1]
    summary = benign_summary(table, frozenset(), sim.problem.heldout)
    assert summary["heldout/pm/acc"] == pytest.approx(np.mean([evaluations[c].pm.test_acc for c in (8, 9)]))
    assert summary["pm/acc"] == pytest.approx(np.mean([evaluations[c].pm.test_acc for c in range(8)]))
    assert sum(sim.host.info[c].weight for c in range(8)) == pytest.approx(1.0)  # weights over training clients


def test_the_teacher_is_a_larger_network_that_only_the_coordinator_holds(tmp_path, monkeypatch):
    """The default teacher (pretrained model) is the next larger architecture (mlr -> mlp; mlp -> cnn on images),
    pretrained on first use and cached; the CRD machinery, the teacher and D_s live in the coordinator's algorithm
    only."""
    from raysim.algorithms.augfl.teacher import teacher_architecture

    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    sim = _sim({**META, "val_fraction": 0.0}, regularizer="crd", query_split="test", **{"lambda": 5.0})
    transfer = sim.coordinator.algorithm._transfer
    assert transfer is not None and sim.host.algorithm._transfer is None and sim.host.algorithm._teacher is None
    assert sim.problem.server_data.pretrained_model == "mlp" and len(transfer.y) == META["server_samples"]
    assert sim.problem.server_data.pretrained.size > sim.problem.init_params.size
    assert list(tmp_path.glob("teacher/*-mlp-*.npz"))  # pretrained on first use, cached
    losses = [
        sim.coordinator.aggregate(sim.host.train(r, list(range(4)), sim.coordinator.broadcast())[0]) for r in range(15)
    ]
    assert losses[-1]["transfer_loss"] < losses[0]["transfer_loss"]  # theta and the heads learn the teacher's structure
    image = validate_config(tiny_config(algorithm={"name": "augfl"}, model={"name": "mlp"})).algorithm
    assert teacher_architecture(image, "mlp", (1, 28, 28)) == "cnn"
    assert teacher_architecture(image, "mlp", (20,)) == "mlp"
    assert teacher_architecture(image, "resnet8x4", (3, 32, 32)) == "resnet32x4"  # the paper's pair (augfl.md 4.2)


def test_the_pretrained_model_is_asked_for_as_a_training_request_and_then_read_from_the_cache(tmp_path, monkeypatch):
    """AugFL's server_data hook yields one TrainModel request on the first held-back pool (the runtime runs it) when
    nothing is cached, none once the file exists; an algorithm without server data returns no generator."""
    from raysim.algorithms import build_algorithm
    from raysim.algorithms.requests import TrainModel
    from raysim.models.flat import ModelSpec
    from raysim.runtime.problem import run_server_requests, server_context

    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    config = validate_config(tiny_config(algorithm={"name": "augfl", "regularizer": "crd"}, partition=META))
    dataset = config.dataset.load(config.seed)
    context = server_context(config, dataset)
    assert [len(pool.y) for pool in context.pools] == [META["reserved"], META["server_samples"]]
    spec = ModelSpec(config.model.name, dataset.input_shape, dataset.output_dim, dataset.task).build().spec
    algorithm = build_algorithm(config.algorithm, spec)
    request = next(algorithm.server_data(context))
    assert isinstance(request, TrainModel) and request.model == "mlp" and len(request.y) == META["reserved"]
    data = run_server_requests(algorithm.server_data(context), context)
    assert list(tmp_path.glob("teacher/*-mlp-*.npz")) and data.pretrained_model == "mlp"
    assert len(data.y) == META["server_samples"]
    with pytest.raises(StopIteration) as cached:  # no request: the file is read
        next(algorithm.server_data(context))
    np.testing.assert_array_equal(cached.value.value.pretrained, data.pretrained)
    fedavg = validate_config(tiny_config(algorithm={"name": "fedavg"}, partition=META))
    assert build_algorithm(fedavg.algorithm, spec).server_data(context) is None


def test_teacher_settings_that_cannot_work_fail_before_any_ray_work():
    from raysim.errors import ConfigError
    from raysim.runtime.problem import prepare

    with pytest.raises(ConfigError, match="partition.scheme=dirichlet"):
        prepare(validate_config(tiny_config(algorithm={"name": "augfl", "regularizer": "crd"})))
    mismatch = {"name": "augfl", "regularizer": "l2", "teacher_model": "mlp"}
    with pytest.raises(ConfigError, match="algorithm.teacher_model=mlp: regularizer l2"):
        prepare(validate_config(tiny_config(algorithm=mismatch, partition=META)))


def test_the_teachers_old_pm_keys_still_load_as_their_teacher_keys(tmp_path):
    """`pm_model`, `pm_path`, `pm_epochs` and `pm_lr` (the teacher's keys before PM came to mean the personalized
    model only) are aliases: in a file and under --set (a text field stays text), shown by their new names; one
    setting under both names, or a bool for its number, is refused as for any key."""
    from raysim.config import load_config
    from raysim.errors import ConfigError
    from raysim.reference import config_reference

    old = {"name": "augfl", "pm_model": "cnn", "pm_path": "teacher.npz", "pm_epochs": 3, "pm_lr": 0.2}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(tiny_config(algorithm=old, partition=META)))
    settings = load_config(path).algorithm
    assert (settings.teacher_model, settings.teacher_weights, settings.teacher_epochs, settings.teacher_lr) == (
        "cnn",
        "teacher.npz",
        3,
        0.2,
    )
    shown = load_config(path).shown()["algorithm"]
    assert shown["teacher_epochs"] == 3 and not any(key.startswith("pm_") for key in shown)
    assert load_config(path, ["algorithm.pm_path=007"]).algorithm.teacher_weights == "007"  # text, not the number 7
    assert load_config(path, ["algorithm.pm_epochs=4"]).algorithm.teacher_epochs == 4
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump(tiny_config(algorithm={**old, "teacher_lr": 0.1}, partition=META)))
    with pytest.raises(ConfigError, match=r"^algorithm\.teacher_lr: given twice, also as pm_lr; keep one$"):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"^algorithm\.pm_epochs: must be an integer, not a bool"):
        load_config(path, ["algorithm.pm_epochs=true"])
    assert "| `algorithm.teacher_epochs` |" in config_reference() and "(old key `pm_epochs`, still accepted)" in (
        config_reference()
    )
