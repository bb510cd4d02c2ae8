"""FedSLR's Appendix A.2 ablations: GPGD (server-side nuclear prox of FedAvg's mean, eqs. 20-21) and LPGD (the prox
inside every local step, eqs. 18-19, through the term Nuclear). Both are FedAvg at lambda = 0; GPGD's global model
and LPGD's local models are low-rank with the ranks the thresholds give."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms.gpgd import Gpgd, GpgdSettings
from raysim.algorithms.lpgd import Lpgd, LpgdSettings
from raysim.algorithms.prox import layerwise_svt, matrixize
from raysim.algorithms.requests import LocalSGD, scale_loss
from raysim.algorithms.terms import Nuclear
from raysim.config import validate_config
from raysim.models.flat import FlatModel
from raysim.training.local import ClientData, LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

SECTIONS = {"clients": {"count": 5, "per_round": 3}, "model": {"name": "mlp"}}


def _sim(algorithm: dict) -> InProcess:
    return InProcess(validate_config(tiny_config(algorithm={"lr": 0.05, "batch_size": 16, **algorithm}, **SECTIONS)))


def _singular_values(sim: InProcess, vector: np.ndarray) -> dict[str, torch.Tensor]:
    spec = sim.problem.params
    return {
        name: torch.linalg.svdvals(matrixize(torch.from_numpy(vector[spec.slice(name)].astype(np.float64)).view(shape)))
        for name, shape in zip(spec.names, spec.shapes, strict=True)
        if len(shape) >= 2
    }


@pytest.mark.parametrize("name", ["gpgd", "lpgd"])
def test_lambda_zero_is_fedavg_with_uniform_aggregation(name):
    ablation = _sim({"name": name, "lambda": 0.0, "epochs": 1, "lr_decay": 1.0})
    fedavg = _sim({"name": "fedavg", "aggregation": "uniform"})
    for round_index in range(2):
        ablation.round(round_index), fedavg.round(round_index)
        np.testing.assert_allclose(ablation.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-6)


def test_gpgd_global_model_is_the_svt_of_the_mean_with_the_rank_the_threshold_gives():
    """Eq. 21: w = Prox_{lambda eta_g ||.||_*}(mean of the selected w_i); each layer's rank is the number of the
    mean's singular values above lambda eta_g, and those that are kept shrink by exactly the threshold."""
    lam, eta_g = 0.12, 10.0
    gpgd = _sim({"name": "gpgd", "lambda": lam, "eta_g": eta_g})
    fedavg = _sim({"name": "fedavg", "aggregation": "uniform", "epochs": 2})
    metrics = gpgd.round(0)
    fedavg.round(0)
    mean = fedavg.coordinator.global_model()  # the same local SGD from the same w_0: FedAvg's uniform mean
    before, after = _singular_values(gpgd, mean), _singular_values(gpgd, gpgd.coordinator.global_model())
    threshold = lam * eta_g
    for name, values in before.items():
        rank = int((values > threshold).sum())
        assert metrics[f"rank/{name}"] == rank and gpgd.server.ranks[name] == rank
        np.testing.assert_allclose(after[name][:rank], values[:rank] - threshold, atol=2e-5)
        assert rank == len(values) or float(after[name][rank:].max()) < 1e-5
    assert any(gpgd.server.ranks[name] < len(values) for name, values in before.items())  # the prox cut something
    spec = gpgd.problem.params
    expected = layerwise_svt(mean, spec, threshold).params
    np.testing.assert_allclose(gpgd.coordinator.global_model(), expected, atol=1e-5)
    assert gpgd.coordinator.broadcast_bytes() == 4 * (gpgd.server.model.size + 1)
    assert gpgd.coordinator.broadcast_bytes() < 4 * spec.size  # the low-rank downlink is factored


def _trainer_and_data() -> tuple[LocalTrainer, ClientData]:
    generator = np.random.default_rng(0)
    x = generator.normal(size=(40, 6)).astype(np.float32)
    y = generator.integers(0, 3, size=40)
    return LocalTrainer(FlatModel("mlp", (6,), 3)), ClientData(x, y, np.arange(40), np.arange(0), np.arange(0))


def test_local_sgd_nuclear_thresholds_every_matrix_after_every_step():
    """The term Nuclear (LPGD eq. 18): each step is x <- SVT_{lr*nuclear}(x - lr grad) layer by layer, so after
    every step each matrix's rank is the number of singular values of its gradient step above lr * nuclear; 1-D
    parameters take the plain step. Chained one-step requests equal one request of several full-batch steps."""
    trainer, data = _trainer_and_data()
    spec, lr, nuclear = trainer.model.spec, 0.5, 0.6
    x = np.random.default_rng(1).normal(scale=0.2, size=spec.size).astype(np.float32)
    start, cut = x.copy(), []
    for _step in range(3):
        _, grad = trainer.model.loss_and_grad(torch.from_numpy(x), torch.from_numpy(data.x), torch.from_numpy(data.y))
        plain = x - lr * grad.numpy()
        x = trainer.sgd(LocalSGD(x, 1, lr, 40, terms=(Nuclear(nuclear),)), data, np.random.default_rng(2)).params
        for name, shape in zip(spec.names, spec.shapes, strict=True):
            if len(shape) < 2:
                np.testing.assert_allclose(x[spec.slice(name)], plain[spec.slice(name)], atol=1e-6)
                continue
            before = torch.linalg.svdvals(matrixize(torch.from_numpy(plain[spec.slice(name)]).view(shape)))
            after = torch.linalg.svdvals(matrixize(torch.from_numpy(x[spec.slice(name)]).view(shape)))
            rank = int((before > lr * nuclear).sum())
            cut.append(0 < rank < len(before))
            assert int((after > 1e-5).sum()) == rank
        np.testing.assert_allclose(x, layerwise_svt(plain, spec, lr * nuclear).params, atol=1e-5)
    assert any(cut)  # some layer lost part of its rank at some step
    chained = trainer.sgd(LocalSGD(start, 3, lr, 40, terms=(Nuclear(nuclear),)), data, np.random.default_rng(2)).params
    np.testing.assert_allclose(chained, x, atol=1e-4)
    vectorized = VectorizedTrainer(trainer.model, chunk=2)
    jobs = [(LocalSGD(start, 3, lr, 40, terms=(Nuclear(nuclear),)), data, np.random.default_rng(2)) for _ in range(2)]
    for result in vectorized.sgd(jobs):  # one client at a time (no lockstep SVD): LocalTrainer's result
        np.testing.assert_array_equal(result.params, chained)


def test_lpgd_local_models_are_low_rank_and_their_mean_in_general_is_not():
    """A.2: every local model is low-rank (the per-step prox), the server's uniform mean of them is not, so the
    downlink stays dense."""
    lpgd = _sim({"name": "lpgd", "lambda": 0.1, "lr": 0.1})
    records = []
    original = lpgd.host.train

    def train(round_index, selected, broadcast):
        partial, table = original(round_index, selected, broadcast)
        records.append(table)
        return partial, table

    lpgd.host.train = train
    lpgd.round(0)
    fractions = records[0]["local_rank_fraction"].to_pylist()
    assert len(fractions) == 3 and all(0 < f < 1 for f in fractions)
    model = lpgd.coordinator.global_model()
    assert lpgd.host.algorithm.rank_fraction(model) > max(fractions)
    assert lpgd.coordinator.broadcast_bytes() == 4 * (lpgd.problem.params.size + 1)


def test_nuclear_request_checks_and_loss_scaling():
    with pytest.raises(ValueError, match="nuclear"):
        LocalSGD(np.zeros(4, np.float32), 1, 0.1, 4, terms=(Nuclear(0.1),), mask=np.ones(4, bool))
    scaled = scale_loss(LocalSGD(np.zeros(4, np.float32), 1, 0.1, 4, terms=(Nuclear(0.3),)), 0.5)
    assert (scaled.lr, scaled.terms[0].weight) == (0.05, 0.6)
    assert GpgdSettings().lam == LpgdSettings().lam == 1e-4
    assert Gpgd.stacks and Lpgd.stacks
