"""FLAME's own mathematics (flame.md 1.3-1.6), on the real host/coordinator code, in one process."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysim.algorithms import ClientInfo
from raysim.config import validate_config
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess


def test_lemma3_invariant_and_u_equals_theta_every_round():
    """Lemma 3: pi_i = lambda alpha_i (theta_i - w_i) after every round (given pi^0 = 0 and theta^0 = w^0).

    With rho = lambda alpha_i = lambda/m it follows that u_i = w_i + pi_i/rho = theta_i, so the global model is
    the plain mean of the personalized models (flame.md 1.6).
    """
    config = validate_config(tiny_config(algorithm={"name": "flame", "lambda": 2.0, "rho": 0.5, "lr": 0.05}))
    sim = InProcess(config)  # 4 clients: rho = lambda/m = 0.5
    lam, rho, m = 2.0, 0.5, 4
    for round_index in range(4):
        sim.round(round_index)
        thetas = []
        for state in sim.states.values():
            np.testing.assert_allclose(state.pi, lam / m * (state.theta - state.w), atol=2e-6)
            np.testing.assert_allclose(state.w + state.pi / rho, state.theta, atol=2e-6)
            thetas.append(state.theta)
        np.testing.assert_allclose(sim.server.w, np.mean(thetas, axis=0), atol=2e-6)


def test_lemma3_holds_off_the_special_case_too():
    """rho != lambda alpha_i: u_i differs from theta_i, but Lemma 3 still holds and w is the mean of u_i."""
    config = validate_config(tiny_config(algorithm={"name": "flame", "lambda": 1.0, "rho": 1.0, "lr": 0.05}))
    sim = InProcess(config)
    for round_index in range(3):
        sim.round(round_index)
    states = list(sim.states.values())
    for state in states:
        np.testing.assert_allclose(state.pi, 0.25 * (state.theta - state.w), atol=2e-6)
    assert max(np.abs(s.w + s.pi - s.theta).max() for s in states) > 1e-3
    np.testing.assert_allclose(sim.server.w, np.mean([s.w + s.pi / 1.0 for s in states], axis=0), atol=2e-6)


@pytest.mark.parametrize("prox_center", ["local", "global"])
def test_converges_to_closed_form_fixed_point(prox_center):
    """Linear regression with X_i^T X_i = N b_i I has the fixed point (flame.md eq. 136)

        w* = sum_i [b_i theta_hat_i / (b_i + lambda)] / sum_i [b_i / (b_i + lambda)],
        theta_i* = (b_i theta_hat_i + lambda w*) / (b_i + lambda),

    the stationary point of (6): grad f_i(theta_i) + lambda (theta_i - w) = 0 with w = mean theta_i. Full-batch
    gradient steps solve the theta-step almost exactly, so a long run must reach it to float32 accuracy; both
    prox centres (w_i, paper; w, code) share this fixed point.
    """
    b, lam, n, d = [1.0, 2.0, 3.0], 1.0, 40, 4
    problem, theta_hat = orthogonal_regression(b, n, d, seed=3)
    algorithm = {"name": "flame", "lambda": lam, "rho": 0.5, "lr": 0.1, "batch_size": n, "epochs": 40}
    config = validate_config(
        tiny_config(algorithm={**algorithm, "prox_center": prox_center}, clients={"count": 3}, model={"name": "linear"})
    )
    sim = InProcess(config, problem)
    for round_index in range(150):
        sim.round(round_index)
    b_col = np.array(b)[:, None]
    w_star = (b_col * theta_hat / (b_col + lam)).sum(0) / (b_col / (b_col + lam)).sum()
    theta_star = (b_col * theta_hat + lam * w_star) / (b_col + lam)
    np.testing.assert_allclose(sim.server.w, w_star, atol=1e-4)
    for i, state in sim.states.items():
        np.testing.assert_allclose(state.theta, theta_star[i], atol=1e-4)
        np.testing.assert_allclose(state.w, w_star, atol=1e-4)
    np.testing.assert_allclose(sum(s.pi for s in sim.states.values()), 0.0, atol=1e-4)  # sum_i pi_i* = 0 (16)


def test_per_epoch_dual_updates_coincide_with_per_round_when_h_is_1():
    """The authors' code updates w_i/pi_i after every local epoch; with H = 1 that is Algorithm 1 exactly."""
    results = []
    for mode in ("per_round", "per_epoch"):
        config = validate_config(tiny_config(algorithm={"name": "flame", "epochs": 1, "dual_updates": mode}))
        sim = InProcess(config)
        for round_index in range(2):
            sim.round(round_index)
        results.append(sim.server.w)
    np.testing.assert_array_equal(results[0], results[1])


def _exact_prox(targets: dict[int, np.ndarray]):
    """An executor that solves FLAME's theta-step exactly for f_i(theta) = 1/2 ||theta - t_i||^2:
    argmin f_i + lambda/2 ||theta - c||^2 = (t_i + lambda c) / (1 + lambda)."""
    from raysim.algorithms.requests import SGDResult
    from raysim.algorithms.terms import Prox

    def execute_many(requests):
        results = []
        for client_id, request in requests:
            prox = request.term(Prox)
            theta = (targets[client_id] + prox.weight * prox.center) / (1 + prox.weight)
            results.append(SGDResult(theta.astype(np.float32), float(client_id), 1))
        return results

    return execute_many


def _exact_prox_rows(targets: dict[int, np.ndarray], ids: list[int]):
    """`_exact_prox` for a stacked request whose rows are the clients `ids` (run_stacked_step's executor)."""
    from raysim.algorithms.requests import SGDResult
    from raysim.algorithms.terms import Prox

    def execute(request):
        target = np.stack([targets[c] for c in ids])
        prox = request.term(Prox)
        theta = (target + prox.weight * prox.center) / (1 + prox.weight)
        return SGDResult(theta.astype(np.float32), np.array(ids, np.float64), np.ones(len(ids), np.int64))

    return execute


@pytest.mark.parametrize("prox_center", ["local", "global"])
@pytest.mark.parametrize("dual_updates", ["per_round", "per_epoch"])
def test_a_chunk_of_stacked_clients_steps_like_each_client_alone(prox_center, dual_updates):
    """FLAME's client step runs on a chunk's stacked rows (alpha_i a column, Algorithm.stacks): each row's new
    theta_i, w_i, pi_i, upload, message and metrics equal the client's own step, and Lemma 3 holds row by row."""
    from raysim.algorithms import build_algorithm
    from raysim.algorithms.flame import FlameClientState, FlameSettings
    from raysim.execution import run_client_steps, run_stacked_step, stack, unstack_update
    from raysim.models.spec import ParamSpec

    options = {"lambda": 1.7, "rho": 0.3, "epochs": 2, "prox_center": prox_center, "dual_updates": dual_updates}
    settings = FlameSettings(**options)
    algorithm = build_algorithm(settings, ParamSpec(("w",), ((50,),), (0,)))
    generator = np.random.default_rng(3)
    clients = [ClientInfo(i, 10 + i, weight, 7) for i, weight in zip((0, 2, 3, 6), (0.1, 0.25, 0.05, 0.6), strict=True)]
    targets = {c.id: generator.normal(size=50).astype(np.float32) for c in clients}
    states = []
    for _ in clients:
        theta, w = generator.normal(size=(2, 50)).astype(np.float32)
        states.append(FlameClientState(theta, w, (0.2 * generator.normal(size=50)).astype(np.float32)))
    broadcast = generator.normal(size=50).astype(np.float32)
    alone = run_client_steps(algorithm, clients, states, broadcast, _exact_prox(targets))
    ids = [c.id for c in clients]
    stacked = run_stacked_step(algorithm, clients, stack(states), broadcast, _exact_prox_rows(targets, ids))
    assert stacked.state.theta.shape == (4, 50) and stacked.metrics["dual_change"].shape == (4,)
    donated = stack(states)  # in place (ClientChunk.in_place): the same rows, written into the donated arrays
    in_place = run_stacked_step(algorithm, clients, donated, broadcast, _exact_prox_rows(targets, ids), in_place=True)
    for name in ("theta", "w", "pi"):
        assert np.array_equal(getattr(in_place.state, name), getattr(stacked.state, name))
    np.testing.assert_array_equal(in_place.upload.change, stacked.upload.change)
    if dual_updates == "per_round":  # per epoch the round's starting w_i and pi_i are kept
        assert in_place.state.w is donated.w and in_place.state.pi is donated.pi
    together = unstack_update(stacked, len(clients))
    for client, want, got in zip(clients, alone, together, strict=True):
        for name in ("theta", "w", "pi"):
            np.testing.assert_allclose(getattr(got.state, name), getattr(want.state, name), rtol=1e-6, atol=1e-6)
            assert getattr(got.state, name).dtype == np.float32
        np.testing.assert_allclose(got.upload.change, want.upload.change, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(algorithm.message(got), algorithm.message(want), rtol=1e-6, atol=1e-6)
        assert got.metrics.keys() == want.metrics.keys()
        assert all(isinstance(value, float) for value in got.metrics.values())
        np.testing.assert_allclose(list(got.metrics.values()), list(want.metrics.values()), rtol=1e-5, atol=1e-6)
        assert got.metrics["train_loss"] == client.id  # each row's own result came back to it
        lam_alpha = 1.7 * client.weight
        np.testing.assert_allclose(got.state.pi, lam_alpha * (got.state.theta - got.state.w), atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    size=st.integers(1, 70),
    rho=st.floats(0.125, 10.0, width=32),
    lam=st.floats(0.125, 10.0, width=32),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_update_is_equations_12_and_13_bit_for_bit(rows, size, rho, lam, seed):
    """`admm_update` (one compiled pass, in place) gives exactly the float32 bits of (12), (13) and the message
    change written in numpy, for every row alone or together (a row never depends on its neighbours), and its
    norms are those of the differences."""
    from raysim.algorithms.families.consensus import admm_update, paper_message, paper_update

    generator = np.random.default_rng(seed)
    theta, w_i, pi = (generator.normal(size=(rows, size)).astype(np.float32) for _ in range(3))
    w = generator.normal(size=size).astype(np.float32)
    lam_alpha = (lam * generator.uniform(0.01, 1.0, rows)).astype(np.float32)
    rho32, la = np.float32(rho), lam_alpha[:, None]
    want_w, want_pi = paper_update(theta, w_i, pi, w, la, rho32)
    want_delta = paper_message(want_w, want_pi, rho32) - paper_message(w_i, pi, rho32)
    new_w, new_pi = w_i.copy(), pi.copy()
    delta, primal, dual, lemma3 = admm_update(theta, new_w, new_pi, w, lam_alpha, rho32)
    for got, want in ((new_w, want_w), (new_pi, want_pi), (delta, want_delta)):
        assert got.dtype == np.float32 and np.array_equal(got, want)
    np.testing.assert_allclose(primal, np.linalg.norm(want_w - w, axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dual, np.linalg.norm(want_pi - pi, axis=1), rtol=1e-5, atol=1e-6)
    residual = np.linalg.norm(want_pi - la * (theta - want_w), axis=1)  # Lemma 3's: rounding only
    np.testing.assert_allclose(lemma3, residual, rtol=1e-3, atol=1e-6)
    alone_w, alone_pi = w_i[-1:].copy(), pi[-1:].copy()
    alone = admm_update(theta[-1:], alone_w, alone_pi, w, lam_alpha[-1:], rho32)
    assert np.array_equal(alone_w, new_w[-1:]) and np.array_equal(alone[0], delta[-1:])
    assert alone[1][0] == primal[-1] and alone[2][0] == dual[-1] and alone[3][0] == lemma3[-1]
