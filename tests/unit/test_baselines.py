"""pFedMe, Ditto, FedProx and Local on the convex linear-regression problem: each reaches its own fixed point.

Clients have f_i(theta) = 1/(2N) ||X_i theta - y_i||^2 with X_i^T X_i = N b_i I (flame.md App. B-A), so
grad f_i(theta) = b_i (theta - theta_hat_i). Full-batch steps make every local solve exact or a known map.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms import ALGORITHMS
from raysim.algorithms.fedavg import FedAvgSettings
from raysim.algorithms.fedprox import FedProxSettings
from raysim.algorithms.requests import LocalSGD
from raysim.algorithms.terms import Prox
from raysim.config import load_config, validate_config
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.studies.suite import load_suite
from raysim.training.local import ClientData, LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.convex import B, N, b, run_orthogonal
from tests.support.experiments import tiny_config
from tests.support.paths import ROOT


def test_pfedme_reaches_the_moreau_envelope_stationary_point():
    """With H = 1 full-batch step per round: theta_i <- theta_i - eta (b_i (theta_i - th_i) + lambda (theta_i - w)),
    w_i = w - eta_2 lambda (w - theta_i), and w = mean_i w_i. A fixed point needs b_i (theta_i - th_i) +
    lambda (theta_i - w) = 0 and mean_i (w - theta_i) = 0: theta_i* = (b_i th_i + lambda w*)/(b_i + lambda) with
    w* = mean_i theta_i*, the stationary point of (6), i.e. FLAME's closed form (eq. 136). atol 1e-4."""
    lam = 1.0
    sim, theta_hat = run_orthogonal(
        {"name": "pfedme", "lambda": lam, "global_lr": 0.5, "lr": 0.2, "batch_size": N, "epochs": 1}, 200
    )
    w_star = (b * theta_hat / (b + lam)).sum(0) / (b / (b + lam)).sum()
    theta_star = (b * theta_hat + lam * w_star) / (b + lam)
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.theta, theta_star[i], atol=1e-4)


def test_ditto_global_is_the_consensus_optimum_and_personal_models_its_prox():
    """Ditto's global part is FedAvg; with one full-batch step per round its fixed point solves
    sum_i b_i (w - th_i) = 0, so w* = sum_i b_i th_i / sum_i b_i (no client drift with a single step). The
    personal model minimizes f_i(v) + lambda/2 ||v - w*||^2: v_i* = (b_i th_i + lambda w*)/(b_i + lambda)."""
    lam = 2.0
    sim, theta_hat = run_orthogonal({"name": "ditto", "lambda": lam, "lr": 0.2, "batch_size": N, "epochs": 1}, 150)
    w_star = (b * theta_hat).sum(0) / b.sum()
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.v, (B[i] * theta_hat[i] + lam * w_star) / (B[i] + lam), atol=1e-4)


def test_fedprox_reaches_its_biased_fixed_point():
    """With the local problem f_i(theta) + mu/2 ||theta - w||^2 solved exactly, theta_i(w) = (b_i th_i + mu w) /
    (b_i + mu) and the uniform server mean gives w* = sum_i [b_i th_i/(b_i+mu)] / sum_i [b_i/(b_i+mu)]: not the
    consensus optimum sum_i b_i th_i / sum_i b_i when the b_i differ (FedProx's known bias), which the test
    also checks. 60 full-batch steps at lr 0.2 contract the local error by at least 0.6^60."""
    mu = 1.0
    algorithm = {"name": "fedprox", "mu": mu, "aggregation": "uniform", "lr": 0.2, "batch_size": N, "epochs": 60}
    sim, theta_hat = run_orthogonal(algorithm, 40)
    w_star = (b * theta_hat / (b + mu)).sum(0) / (b / (b + mu)).sum()
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    assert np.linalg.norm(sim.server.w - (b * theta_hat).sum(0) / b.sum()) > 1e-2


def test_local_reaches_each_clients_own_least_squares_and_sends_nothing():
    """Local minimizes f_i alone: theta_i -> th_i = (X_i^T X_i)^-1 X_i^T y_i; the global model stays the initial
    one and the upload is empty (zero bytes)."""
    sim, theta_hat = run_orthogonal({"name": "local", "lr": 0.2, "batch_size": N, "epochs": 5}, 20)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.theta, theta_hat[i], atol=1e-4)
    np.testing.assert_array_equal(sim.server.w, sim.problem.init_params)
    algorithm = sim.host.algorithm
    assert algorithm.uplink_bytes(algorithm.Upload()) == 0
    assert algorithm.downlink_bytes(algorithm.broadcast(sim.server)) == 0


def _loss_scale_problem() -> tuple[FlatModel, ClientData, np.ndarray, np.ndarray]:
    """An MLP, one client of 24 samples, a start point and a prox centre away from it."""
    source = np.random.default_rng(3)
    x = source.normal(size=(24, 6)).astype(np.float32)
    y = source.integers(0, 3, 24).astype(np.int64)
    empty = np.array([], np.int64)
    model = FlatModel("mlp", (6,), 3)
    start = model.initial_parameters(0)
    center = (start + 0.3 * source.normal(size=start.shape)).astype(np.float32)
    return model, ClientData(x, y, np.arange(24), empty, empty), start, center


def _execute(executor: str, model: FlatModel, request: LocalSGD, data: ClientData) -> np.ndarray:
    if executor == "sequential":
        return LocalTrainer(model).sgd(request, data, np.random.default_rng(0)).params
    return VectorizedTrainer(model, 2).sgd([(request, data, np.random.default_rng(0))])[0].params


M = 4


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_loss_scale_without_prox_is_the_step_lr_over_m(executor):
    """loss_scale 1/m weights the loss and its weight_decay term by 1/m; with no other term that is SGD with lr/m:
    the same iterates, bit for bit (momentum included), on either executor."""
    model, data, start, _center = _loss_scale_problem()
    sgd = {"name": "fedavg", "lr": 0.4, "batch_size": 8, "epochs": 2, "momentum": 0.5, "weight_decay": 0.01}
    scaled = FedAvgSettings(**sgd, loss_scale="1/m")
    plain = FedAvgSettings(**{**sgd, "lr": 0.4 / M})
    got = _execute(executor, model, scaled.scaled(scaled.local_sgd(start), M), data)
    np.testing.assert_array_equal(got, _execute(executor, model, plain.scaled(plain.local_sgd(start), M), data))
    assert np.abs(got - start).max() > 1e-3


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_loss_scale_leaves_the_prox_term_unscaled(executor):
    """The FedAPM authors' FedProx step, g = (1/m)(grad f_i + mu w) + p (w - w_c) (fedapm.md 1.5): one full-batch
    step with loss_scale 1/m is w - lr g, and differs from the step with lr/m (which scales the prox term too) by
    exactly the prox term's unscaled part, lr p (1 - 1/m) (w - w_c). float32 rounding: atol 1e-6."""
    model, data, start, center = _loss_scale_problem()
    settings = FedProxSettings(name="fedprox", lr=0.4, batch_size=24, epochs=1, weight_decay=0.01, mu=0.5)
    scaled = settings.model_copy(update={"loss_scale": "1/m"})
    request = scaled.scaled(scaled.local_sgd(start, terms=(Prox(center, settings.mu),)), M)
    got = _execute(executor, model, request, data)
    xb, yb = (torch.from_numpy(a) for a in data.arrays("train"))
    _loss, grad = model.loss_and_grad(torch.from_numpy(start.copy()), xb, yb)
    w = start.astype(np.float64)
    authors = w - 0.4 * ((grad.numpy() + 0.01 * w) / M + 0.5 * (w - center))
    np.testing.assert_allclose(got, authors, atol=1e-6)
    lr_over_m = settings.model_copy(update={"lr": 0.4 / M})
    other = _execute(executor, model, lr_over_m.local_sgd(start, terms=(Prox(center, settings.mu),)), data)
    np.testing.assert_allclose(other - got, 0.4 * 0.5 * (1 - 1 / M) * (w - center), atol=1e-6)


def test_loss_scale_only_where_the_step_applies_it():
    """loss_scale 1/m on an algorithm that weights its loss otherwise (FedAPM's alpha_i) is refused; the run's
    parameters state each method's step on f_i: lr/m with loss_scale 1/m, lr * alpha_i for FedAPM."""
    with pytest.raises(ConfigError, match="algorithm.loss_scale: algorithm 'fedapm' does not scale its loss"):
        validate_config(tiny_config(algorithm={"name": "fedapm", "loss_scale": "1/m"}, model={"name": "mlp"}))
    clients = {"count": 20}
    fedavg = {"name": "fedavg", "lr": 0.1, "loss_scale": "1/m"}
    assert validate_config(tiny_config(algorithm=fedavg, clients=clients)).flat()["algorithm.effective_lr"] == "0.005"
    fedapm = {"name": "fedapm", "lr": 0.1}
    assert validate_config(tiny_config(algorithm=fedapm, clients=clients)).flat()["algorithm.effective_lr"] == "0.005"
    plain = validate_config(tiny_config(algorithm={"name": "fedalt", "lr": 0.1}, clients=clients)).flat()
    assert plain["algorithm.effective_lr"] == "0.1"


def test_the_shipped_comparison_configs_are_step_matched():
    """Issue 35: FedAPM's comparison configs run every method at the same step on the unweighted loss, as the
    runs' `algorithm.effective_lr` parameter states: 0.05 in configs/compare.yaml (FedAPM with alpha_i = 1), 0.01 in
    configs/fedapm.yaml (alpha_i = 1/m), fedalt.yaml and fedsim.yaml (loss_scale 1/m)."""
    configs = ROOT / "configs"
    suite = load_suite(configs / "compare.yaml").experiments()
    # Per-FedAvg's and APFL's steps are not SGDSettings' (no loss weight to state): their lr is the step itself
    flat = {name: config.flat() for name, config in suite}
    compare = {name: str(step.get("algorithm.effective_lr", step["algorithm.lr"])) for name, step in flat.items()}
    assert set(compare.values()) == {"0.05"}
    # the baselines suite runs every method but those of the few-shot protocol with server data (AugFL's suite)
    pretrained = {"augfl", "kd_only", "fedlp", "fedpcl"}
    assert {config.algorithm.name for _, config in suite} == set(ALGORITHMS.names()) - pretrained
    names = ("fedapm", "fedalt", "fedsim")
    steps = {name: load_config(configs / f"{name}.yaml").flat()["algorithm.effective_lr"] for name in names}
    assert steps == {"fedapm": "0.01", "fedalt": "0.01", "fedsim": "0.01"}
