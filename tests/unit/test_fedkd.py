"""FedKD (raysim.algorithms.fedkd): the adaptive mutual distillation against eq. 1-6 written out, with and without
a gradient through its weight; the truncated SVD keeps the fewest singular values that reach the energy threshold
(eq. 8) and counts U, Sigma, V; the threshold's schedule (eq. 9); the server's truncated mean update on hand-made
uploads; the turns of mentee and mentor; with the distillation weighted 0 and no compression the mentee is FedAvg;
the bytes sent each way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedkd import (
    FedKdServerState,
    FedKdSettings,
    FedKdUpload,
    MutualDistillation,
    adaptive_distillation,
    energy_rank,
    svd_size,
    truncate,
)
from raysim.algorithms.requests import batch_steps
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from tests.support.features import CLASSES, DIM
from tests.support.split_models import simulate, step_results

SPEC = ParamSpec(("w", "b", "conv"), ((6, 5), (6,), (2, 3, 2, 2)), (0, 30, 36))


def _batch(seed: int = 0):
    """A model, a point, a batch with every class, and the partner model."""
    source = np.random.default_rng(seed)
    model = FlatModel("mlp", (DIM,), CLASSES)
    x = torch.from_numpy(source.normal(size=(12, DIM)).astype(np.float32))
    y = torch.from_numpy(np.arange(12) % CLASSES)
    return model, torch.from_numpy(model.initial_parameters(seed)), x, y, model.initial_parameters(seed + 1)


def _written_out(model, point, x, y, partner, weight, hidden, detach):
    """eq. 3 (or 6) from explicit softmaxes: CE + weight [KL(p_partner || p) + MSE(z, z_partner)] / (CE + CE_p)."""
    with torch.no_grad():
        partner_z, partner_logits = model.features(torch.from_numpy(partner), x)
    z, logits = model.features(point, x)
    rows = torch.arange(len(y))
    log_p = logits.log_softmax(1)
    log_q = partner_logits.log_softmax(1)
    task, partner_task = -log_p[rows, y].mean(), -log_q[rows, y].mean()
    kl = (log_q.exp() * (log_q - log_p)).sum(1).mean()
    mse = ((z - partner_z) ** 2).mean() if hidden else 0.0
    denominator = (task.detach() if detach else task) + partner_task
    return task + weight * (kl + mse) / denominator


def test_the_adaptive_weight_is_the_inverse_of_both_task_losses():
    assert adaptive_distillation(0.5, 1.5, 0.3) == pytest.approx(0.5 + 0.3 / 2.0)
    assert adaptive_distillation(0.5, 1.5, 0.3, weight=2.0) == pytest.approx(0.5 + 0.6 / 2.0)
    # the worse both models predict, the less they distil: the same KL counts four times less at 4x the losses
    assert adaptive_distillation(2.0, 6.0, 0.3) - 2.0 == pytest.approx((adaptive_distillation(0.5, 1.5, 0.3) - 0.5) / 4)


@pytest.mark.parametrize(("weight", "hidden", "detach"), [(1.0, True, False), (0.5, False, False), (1.0, True, True)])
def test_the_mutual_distillation_is_eq_1_to_3_written_out(weight, hidden, detach):
    model, point, x, y, partner = _batch(1)
    term = MutualDistillation(partner, weight, hidden, detach)
    loss, grad = term.loss_and_grad(model, point, x, y, None)
    at = point.clone().requires_grad_(True)
    expected = _written_out(model, at, x, y, partner, weight, hidden, detach)
    (expected_grad,) = torch.autograd.grad(expected, at)
    assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
    np.testing.assert_allclose(grad.numpy(), expected_grad.numpy(), rtol=1e-4, atol=1e-6)


def test_detaching_the_weight_changes_the_gradient_not_the_loss():
    model, point, x, y, partner = _batch(2)
    through, grad_through = MutualDistillation(partner).loss_and_grad(model, point, x, y, None)
    detached, grad_detached = MutualDistillation(partner, detach_weight=True).loss_and_grad(model, point, x, y, None)
    assert through == pytest.approx(detached, rel=1e-6)
    assert float((grad_through - grad_detached).norm()) > 1e-4


def test_weighted_zero_it_is_the_task_loss_and_a_model_equal_to_its_partner_distils_nothing():
    model, point, x, y, partner = _batch(3)
    plain = model.loss_and_grad(point, x, y)
    zero = MutualDistillation(partner, weight=0.0).loss_and_grad(model, point, x, y, None)
    assert zero[0] == pytest.approx(plain[0], rel=1e-6)
    np.testing.assert_allclose(zero[1].numpy(), plain[1].numpy(), rtol=1e-5, atol=1e-7)
    itself = MutualDistillation(point.numpy().copy()).loss_and_grad(model, point, x, y, None)
    assert itself[0] == pytest.approx(plain[0], rel=1e-5)  # KL and MSE are 0 (their gradients too)
    np.testing.assert_allclose(itself[1].numpy(), plain[1].numpy(), rtol=1e-4, atol=1e-6)


def test_the_energy_rank_is_the_fewest_singular_values_that_reach_the_threshold():
    s = np.array([4.0, 2.0, 1.0, 0.5])  # energy fractions 0.753, 0.941, 0.988, 1
    assert [energy_rank(s, t) for t in (0.5, 0.753, 0.94, 0.95, 0.988, 0.99, 1.0)] == [1, 2, 2, 3, 3, 4, 4]
    assert energy_rank(np.array([16.0, 4.0]) ** 0.5, 0.8) == 1  # exactly 0.8: reached
    assert energy_rank(np.zeros(3), 0.95) == 0


def test_the_truncation_keeps_the_energy_fraction_and_counts_u_sigma_v():
    source = np.random.default_rng(0)
    left, _ = np.linalg.qr(source.normal(size=(6, 5)))
    right, _ = np.linalg.qr(source.normal(size=(5, 5)))
    sigma = np.array([5.0, 3.0, 1.0, 0.5, 0.1])
    update = source.normal(size=SPEC.size)
    update[SPEC.slice("w")] = ((left * sigma) @ right.T).ravel()
    conv = update[SPEC.slice("conv")].reshape(2, 3, 2, 2)
    conv_sigma = np.linalg.svd(conv.transpose(0, 2, 1, 3).reshape(4, 6), compute_uv=False)
    for energy in (0.8, 0.95, 0.99, 1.0):
        sent = truncate(update, SPEC, energy)
        rank = energy_rank(sigma, energy)
        assert sent.ranks["w"] == rank and sent.ranks["conv"] == energy_rank(conv_sigma, energy)
        kept = sent.params[SPEC.slice("w")].reshape(6, 5)
        np.testing.assert_allclose(kept, (left[:, :rank] * sigma[:rank]) @ right[:, :rank].T, atol=1e-12)
        assert (sigma[:rank] ** 2).sum() / (sigma**2).sum() >= energy - 1e-12  # the fraction kept reaches T
        assert (sigma[: rank - 1] ** 2).sum() / (sigma**2).sum() < energy  # one fewer does not
        np.testing.assert_array_equal(sent.params[SPEC.slice("b")], update[SPEC.slice("b")])  # 1-D: dense
        assert sent.numbers == min(30, rank * 12) + 6 + min(24, sent.ranks["conv"] * 11)
    full = truncate(update, SPEC, 1.0)
    np.testing.assert_allclose(full.params, update, atol=1e-12)
    assert svd_size((6, 5), 2) == 24 and svd_size((6, 5), 3) == 30 and svd_size((7,), 0) == 7


def test_the_threshold_rises_from_t_start_to_t_end_over_the_ramp():
    settings = FedKdSettings(t_start=0.9, t_end=1.0, ramp_rounds=4)
    assert [settings.energy(t) for t in range(6)] == pytest.approx([0.925, 0.95, 0.975, 1.0, 1.0, 1.0])


def _server_step(compression: str, updates: list[np.ndarray], weights: list[float]):
    algorithm = build_algorithm(FedKdSettings(compression=compression, t_start=0.95, t_end=0.95), SPEC)
    mentee = np.random.default_rng(1).normal(size=SPEC.size).astype(np.float32)
    server = FedKdServerState(mentee, 3, SPEC.size)
    weighted = sum(a * (mentee.astype(np.float64) + g) for a, g in zip(weights, updates, strict=True))
    total = FedKdUpload(weighted, np.float32(sum(weights)), 0.0)
    return algorithm, mentee, *algorithm.server_step(server, total, len(updates))


def test_the_server_moves_the_mentee_by_the_truncated_mean_update():
    source = np.random.default_rng(2)
    a, b = source.normal(size=6), source.normal(size=5)
    low_rank = np.zeros(SPEC.size)
    low_rank[SPEC.slice("w")] = np.outer(a, b).ravel()
    low_rank[SPEC.slice("b")] = 1.0
    algorithm, mentee, server, metrics = _server_step("both", [low_rank, 3 * low_rank], [1.0, 1.0])
    np.testing.assert_allclose(server.mentee, mentee + 2 * low_rank, atol=1e-5)  # rank 1: sent exactly
    assert server.downlink == 12 + 6 and server.round == 4  # one triplet, the bias; the zero conv sends nothing
    assert algorithm.downlink_bytes(algorithm.broadcast(server)) == 4 * 18
    assert metrics["downlink_fraction"] == pytest.approx(18 / SPEC.size)

    dense = [source.normal(size=SPEC.size) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    mean = sum(w * g for w, g in zip(weights, dense, strict=True)) / 8
    algorithm, mentee, server, _ = _server_step("both", dense, weights)
    truncated = truncate(mean, SPEC, 0.95)
    np.testing.assert_allclose(server.mentee, mentee + truncated.params, atol=1e-5)
    assert server.downlink == truncated.numbers and truncated.ranks["w"] < 5
    algorithm, mentee, server, _ = _server_step("uplink", dense, weights)
    np.testing.assert_allclose(server.mentee, mentee + mean, atol=1e-5)
    assert server.downlink == SPEC.size


@pytest.mark.parametrize("alternation", ["epoch", "step"])
def test_mentee_and_mentor_take_turns_each_distilling_from_the_other_as_it_stands(alternation):
    sim = simulate({"name": "fedkd", "epochs": 2, "alternation": alternation, "mentee_lr": 0.02}, rounds=1)
    client = 0
    before = sim.states[client]
    broadcast = sim.coordinator.broadcast()
    recorded = step_results(sim, client, broadcast)
    turns = 2 if alternation == "epoch" else int(batch_steps(sim.host.info[client].num_train, 32, 2))
    assert len(recorded.requests) == 2 * turns
    mentee, mentor = broadcast.mentee, before.mentor
    for index, (request, result) in enumerate(zip(recorded.requests, recorded.results, strict=True)):
        (term,) = request.terms
        assert isinstance(term, MutualDistillation) and request.epochs == 1
        assert request.random_batches == (None if alternation == "epoch" else 1)
        if index % 2 == 0:  # the mentee, against the mentor as it stands
            np.testing.assert_array_equal(request.start, mentee)
            np.testing.assert_array_equal(term.partner, mentor)
            assert request.lr == 0.02
            mentee = result.params
        else:  # the mentor, against the mentee just trained
            np.testing.assert_array_equal(request.start, mentor)
            np.testing.assert_array_equal(term.partner, mentee)
            assert request.lr == 0.05
            mentor = result.params
    np.testing.assert_array_equal(recorded.update.state.mentor, mentor)
    assert recorded.update.state.trained


def test_weighted_zero_without_compression_the_mentee_is_fedavg():
    fedkd = simulate({"name": "fedkd", "weight": 0.0, "compression": "none", "aggregation": "samples"}, rounds=3)
    fedavg = simulate({"name": "fedavg"}, rounds=3)
    np.testing.assert_allclose(fedkd.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-5)
    algorithm = fedkd.host.algorithm
    update = step_results(fedkd, 0, fedkd.coordinator.broadcast()).update
    assert algorithm.uplink_bytes(update.upload) == 4 * (algorithm.params.size + 1)  # FedAvg's: the model and n_i
    assert algorithm.downlink_bytes(fedkd.coordinator.broadcast()) == 4 * algorithm.params.size


def test_the_bytes_sent_are_the_truncated_factors():
    sim = simulate({"name": "fedkd", "t_start": 0.5, "t_end": 0.9, "ramp_rounds": 4}, rounds=1)
    algorithm = sim.host.algorithm
    size = algorithm.params.size
    first = sim.coordinator.broadcast()
    assert first.energy == pytest.approx(0.5 + 0.4 * 2 / 4)  # round 1 of a ramp of 4: T(1)
    server = sim.server
    assert isinstance(server, FedKdServerState) and server.round == 1
    assert algorithm.downlink_bytes(first) == 4 * server.downlink and server.downlink < size
    recorded = step_results(sim, 0, first)
    mentee = recorded.results[-2].params  # the last turn's mentee
    sent = truncate(mentee.astype(np.float64) - first.mentee, algorithm.params, first.energy)
    upload = recorded.update.upload
    assert upload.numbers == sent.numbers and algorithm.uplink_bytes(upload) == 4 * (sent.numbers + 1)
    assert sent.numbers < size and recorded.update.metrics["uplink_fraction"] == pytest.approx(sent.numbers / size)
    np.testing.assert_allclose(upload.weighted, first.mentee + sent.params, atol=1e-6)  # weight 1 (uniform)
    assert upload.weight == 1.0


def test_the_initial_mentee_is_sent_whole_and_a_client_deploys_the_gm_until_it_trains():
    sim = simulate({"name": "fedkd"}, rounds=0)
    algorithm = sim.host.algorithm
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * algorithm.params.size
    state = sim.states[0]
    assert algorithm.personalized_model(state) is None
    sim.round(0, [0])
    assert np.array_equal(algorithm.personalized_model(sim.states[0]), sim.states[0].mentor)
