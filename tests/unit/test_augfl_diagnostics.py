"""AugFL's theory as diagnostics (`diagnostics: true`, augfl.md 3 and 7.2) on a convex problem where every logged
value has a closed form, and its switches for the authors' code: clients that start from their own initialization
(`start: own`), the transfer set cropped and flipped (`server_augment`), and CRD's BatchNorm ResNets.

The convex problem is FLAME's orthogonal linear regression (tests/support/convex.py): L_i(theta) = 1/(2N)
||X_i theta - y_i||^2 with X_i^T X_i = N b_i I, so grad L_i(theta) = b_i (theta - theta_hat_i), the Hessian is b_i I,
phi_i(theta) - theta_hat_i = (1 - alpha b_i)(theta - theta_hat_i), eq. 10's finite difference is exact and the
meta-gradient is d_i(theta) = b_i (1 - alpha b_i)^2 (theta - theta_hat_i). With R_h = ||theta - theta_p||^2 the
stationary point of eq. 2 is theta* = (sum_i w_i c_i theta_hat_i + 2 lambda theta_p) / (sum_i w_i c_i + 2 lambda),
c_i = b_i (1 - alpha b_i)^2."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from raysim.algorithms.augfl.algorithm import AugFlServerData
from raysim.config import validate_config
from raysim.evaluation.summaries import mean_client_metrics
from raysim.models.flat import FlatModel
from raysim.seeding import Stream, rng, torch_seed
from tests.support.augfl import META
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

B, N, D = [1.0, 2.0, 3.0], 40, 4
ALPHA, RHO = 0.1, 2.0


def _pretraining_pool(seed: int = 11, n: int = 50, b: float = 1.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The teacher's task: an orthogonal regression of its own, and its minimizer theta_p (the pretrained model)."""
    generator = np.random.default_rng(seed)
    q, _ = np.linalg.qr(generator.normal(size=(n, D)))
    x = np.sqrt(n * b) * q
    y = x @ generator.normal(size=D) + 0.2 * generator.normal(size=n)
    return x.astype(np.float32), y.astype(np.float32), x.T @ y / (n * b)


def _convex(lam: float, **algorithm) -> tuple[InProcess, np.ndarray, np.ndarray]:
    """AugFL with R_h = ||theta - theta_p||^2 on the orthogonal regression, the teacher being the minimizer of its
    pretraining pool, which the server scores for forgetting."""
    problem, theta_hat = orthogonal_regression(B, N, D, seed=3)
    x_p, y_p, theta_p = _pretraining_pool()
    settings = {
        "name": "augfl",
        "alpha": ALPHA,
        "rho": RHO,
        "lambda": lam,
        "regularizer": "l2",
        "support_split": "train",
        "query_split": "train",
        "diagnostics": True,
        **algorithm,
    }
    config = validate_config(tiny_config(algorithm=settings, clients={"count": len(B)}, model={"name": "linear"}))
    server_data = AugFlServerData(
        theta_p.astype(np.float32),
        "linear",
        x_p[:0],
        y_p[:0],
        "linear",
        (D,),
        1,
        config.seed,
        x_p,
        y_p,
        "regression",
    )
    return InProcess(config, dataclasses.replace(problem, server_data=server_data)), theta_hat, theta_p


def _round(sim: InProcess, round_index: int, selected: list[int] | None = None) -> dict[str, float]:
    """One round as the driver logs it: the server's metrics (`server/...`) and the clients' (`update/...`)."""
    selected = list(range(sim.problem.num_training)) if selected is None else selected
    partial, records = sim.host.train(round_index, selected, sim.coordinator.broadcast())
    return {f"server/{k}": v for k, v in sim.coordinator.aggregate(partial).items()} | mean_client_metrics(records)


def _loss(sim: InProcess, client: int, point: np.ndarray) -> tuple[float, np.ndarray]:
    """L_i and its gradient at `point` over the client's training split, in float64."""
    split = sim.problem.clients[client][1]
    x, y = sim.problem.x[split.train].astype(np.float64), sim.problem.y[split.train].astype(np.float64)
    residual = x @ point - y
    return float(0.5 * np.mean(residual**2)), x.T @ residual / len(y)


def _lagrangian(sim: InProcess, theta: np.ndarray, theta_p: np.ndarray, lam: float) -> float:
    """Eq. 5 from every client's state at the server's theta^t: sum_i w_i L_i(phi_i(theta_i), D^q) + <y_i, theta_i -
    theta> + rho/2 ||theta_i - theta||^2, plus lambda ||theta - theta_p||^2."""
    total = lam * float(np.sum((theta - theta_p) ** 2))
    for client, state in sim.states.items():
        theta_i, y_i = state.theta.astype(np.float64), state.y.astype(np.float64)
        phi = theta_i - ALPHA * _loss(sim, client, theta_i)[1]
        total += sim.host.info[client].weight * _loss(sim, client, phi)[0]
        total += float(y_i @ (theta_i - theta)) + RHO / 2 * float(np.sum((theta_i - theta) ** 2))
    return total


def _stationary(theta_hat: np.ndarray, theta_p: np.ndarray, lam: float) -> np.ndarray:
    c = np.array([b * (1 - ALPHA * b) ** 2 for b in B]) / len(B)
    return (c @ theta_hat + 2 * lam * theta_p) / (c.sum() + 2 * lam)


def test_diagnostics_equal_their_closed_forms_and_vanish_at_the_stationary_point():
    """Each round: the eps-FOSP norm is ||sum_i w_i b_i (1 - alpha b_i)^2 (theta^t - theta_hat_i) + 2 lambda (theta^t -
    theta_p)||, R_h = ||theta^t - theta_p||^2, delta = 1/(10 k + 100), the Lagrangian (5) that of the states (also
    under partial participation: the server's totals cover the clients it did not hear from), and the forgetting
    ||grad L_p(theta^t)|| = b_p ||theta^t - theta_p||. At the end the FOSP norm is ~0, theta = theta*, and the
    Lagrangian is F(theta*) = sum_i w_i L_i(phi_i(theta*)) + lambda R_h(theta*) (the coupling vanishes)."""
    lam = 0.5
    sim, theta_hat, theta_p = _convex(lam)
    c = np.array([b * (1 - ALPHA * b) ** 2 for b in B])
    schedule = [None] * 3 + [[0, 2], [1], [2]] + [None] * 80
    for round_index, selected in enumerate(schedule):
        theta = sim.coordinator.broadcast().astype(np.float64)
        logged = _round(sim, round_index, selected)
        fosp = (c[:, None] * (theta - theta_hat)).mean(0) + 2 * lam * (theta - theta_p)
        if selected is None:  # the round's clients are all; eq. 10's float32 differences over 2 delta: ~1e-5 noise
            assert logged["server/fosp_norm"] == pytest.approx(np.linalg.norm(fosp), rel=2e-4, abs=5e-5)
            deltas = [1 / (10 * state.participations + 100) for state in sim.states.values()]
            assert logged["update/delta"] == pytest.approx(np.mean(deltas))
        assert logged["server/regularizer"] == pytest.approx(np.sum((theta - theta_p) ** 2), rel=1e-6)
        assert logged["server/lagrangian"] == pytest.approx(_lagrangian(sim, theta, theta_p, lam), rel=1e-5, abs=1e-6)
        assert logged["server/pretrain_gradient_norm"] == pytest.approx(
            1.5 * np.linalg.norm(theta - theta_p), rel=1e-4, abs=1e-6
        )
        x_p, y_p, _ = _pretraining_pool()
        pretrain_loss = 0.5 * np.mean((x_p.astype(np.float64) @ theta - y_p) ** 2)
        assert logged["server/pretrain_loss"] == pytest.approx(pretrain_loss, rel=1e-5)
    theta = sim.coordinator.broadcast().astype(np.float64)
    star = _stationary(theta_hat, theta_p, lam)
    np.testing.assert_allclose(theta, star, atol=1e-5)
    assert logged["server/fosp_norm"] < 1e-4
    phi = {i: star - ALPHA * B[i] * (star - theta_hat[i]) for i in range(len(B))}
    objective = np.mean([_loss(sim, i, phi[i])[0] for i in range(len(B))]) + lam * np.sum((star - theta_p) ** 2)
    assert logged["server/lagrangian"] == pytest.approx(objective, rel=1e-5)


def test_forgetting_of_the_pretrained_task_shrinks_with_lambda():
    """Theorem 3's message on the quadratic: at the stationary point ||grad L_p(theta*)|| = b_p ||theta* - theta_p||,
    which a larger lambda makes smaller (theta_p minimizes the pretraining loss), and lambda = 0 forgets most."""
    norms = {}
    for lam in (0.0, 0.5, 2.0):
        sim, theta_hat, theta_p = _convex(lam)
        logged = [_round(sim, r) for r in range(120)][-1]
        star = _stationary(theta_hat, theta_p, lam)
        np.testing.assert_allclose(sim.coordinator.broadcast(), star, atol=1e-5)
        norms[lam] = logged["server/pretrain_gradient_norm"]
        assert norms[lam] == pytest.approx(1.5 * np.linalg.norm(star - theta_p), rel=1e-3)
    assert norms[0.0] > norms[0.5] > norms[2.0] > 0


def test_without_diagnostics_nothing_more_is_computed_or_sent():
    """The default: two requests fewer per client, the plain upload, none of the diagnostic metrics."""
    sim, _, _ = _convex(0.5, diagnostics=False)
    logged = _round(sim, 0)
    assert not {"server/lagrangian", "server/fosp_norm", "server/pretrain_loss", "update/delta"} & set(logged)
    assert sim.coordinator.algorithm._pretraining is None


def _mlp(**algorithm) -> InProcess:
    settings = {"name": "augfl", "alpha": 0.1, "rho": 0.7, "lambda": 0.0, "query_split": "val", **algorithm}
    partition = {"scheme": "dirichlet", "beta": 0.5, "val_fraction": 0.5}
    config = tiny_config(algorithm=settings, partition=partition, model={"name": "mlp"}, rounds=3)
    return InProcess(validate_config(config))


def test_own_start_sends_nothing_in_round_0_and_each_client_starts_from_its_own_seeded_model():
    """`start: own` (the authors' code): round 0 broadcasts nothing; client i runs eqs. 7-12 from its own
    initialization, the model's initializer seeded by theta^0 and its id (so theta_i - y_i / rho, the round's start
    by eq. 12 from y = 0, is that model), the clients' starts differ from each other and from theta^0, and the server
    aggregates their theta_i and y_i by eq. 13; from round 1 on every client receives theta^t."""
    sim, plain = _mlp(start="own"), _mlp()
    init = sim.problem.init_params
    assert sim.coordinator.broadcast() is None and plain.coordinator.broadcast() is not None
    assert sim.coordinator.algorithm.downlink_bytes(sim.coordinator.broadcast()) == 0
    partial, _ = sim.host.train(0, [0, 1, 2, 3], sim.coordinator.broadcast())
    sim.coordinator.aggregate(partial)
    model = FlatModel("mlp", sim.problem.model_spec.input_shape, sim.problem.model_spec.outputs)
    seed = zlib.crc32(np.ascontiguousarray(init).tobytes())
    starts = []
    for client, state in sim.states.items():
        own = model.initial_parameters(torch_seed(seed, Stream.MODEL_INIT, client))
        start = state.theta.astype(np.float64) - state.y.astype(np.float64) / 0.7
        np.testing.assert_allclose(start, own, atol=2e-6)
        assert np.abs(own - init).max() > 0.01
        starts.append(own)
    assert min(np.abs(a - b).max() for i, a in enumerate(starts) for b in starts[i + 1 :]) > 0.01
    states = sim.states.values()
    expected = sum(s.y.astype(np.float64) + 0.7 * s.theta for s in states) / (4 * 0.7)
    np.testing.assert_allclose(sim.coordinator.broadcast(), expected, atol=1e-6)
    assert sim.coordinator.algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * init.size


def test_own_start_equals_broadcast_when_every_client_starts_from_theta0():
    """The switch changes round 0's starting points only: the clients' steps are those of eqs. 7-12 from whatever
    model they start from (a client whose own model were theta^0 would give the plain run's update)."""
    sim = _mlp(start="own")
    algorithm = sim.host.algorithm
    init = sim.problem.init_params
    twin = _mlp()
    for client in range(4):  # replace each client's own start by theta^0: the runs then agree bit for bit
        state = sim.host.steps.states[client]
        sim.host.steps.states[client] = dataclasses.replace(state, phi=init.copy())
    assert algorithm.own_start
    for round_index in range(2):
        _round(sim, round_index)
        _round(twin, round_index)
    np.testing.assert_array_equal(sim.coordinator.broadcast(), twin.coordinator.broadcast())


def _images(tmp_path, n: int = 1000, seed: int = 0):
    """An .npz of n 3x8x8 images of 10 classes (class-dependent means), for the meta partition's pools."""
    generator = np.random.default_rng(seed)
    y = generator.integers(0, 10, n)
    x = generator.normal(size=(n, 3, 8, 8)) + y[:, None, None, None] / 3.0
    path = tmp_path / "images.npz"
    np.savez(path, x=x.astype(np.float32), y=y)
    return path


def test_server_augmentation_crops_and_flips_only_the_transfer_set(tmp_path, monkeypatch):
    """`server_augment: crop_flip`: each round the transfer pass sees D_s zero-padded by 4 (at each channel's darkest
    value, the normalized black) and cropped back at a random corner, then flipped with probability 1/2, drawn from
    the server's stream; the clients' steps (their uploads) are the same as without it, the server's step is not."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    dataset = {"name": "npz", "path": str(_images(tmp_path))}
    crd = {"regularizer": "crd", "lambda": 5.0, "teacher_model": "cnn", "teacher_epochs": 1}
    runs = {}
    for augment in ("none", "crop_flip"):
        algorithm = {"name": "augfl", "alpha": 0.1, "rho": 0.7, "transfer": {"negatives": 16}, **crd}
        config = tiny_config(
            algorithm={**algorithm, "server_augment": augment},
            dataset=dataset,
            partition={**META, "val_fraction": 0.0},
            model={"name": "cnn"},
        )
        sim = InProcess(validate_config(config))
        partial, _ = sim.host.train(0, [0, 1, 2, 3], sim.coordinator.broadcast())
        runs[augment] = (sim, partial)
    (plain, sent), (augmented, sent_augmented) = runs["none"], runs["crop_flip"]
    for name, value in sent.fields.items():  # the clients: untouched
        np.testing.assert_array_equal(value, sent_augmented.fields[name])
    plain.coordinator.aggregate(sent)
    augmented.coordinator.aggregate(sent_augmented)
    assert np.abs(plain.coordinator.broadcast() - augmented.coordinator.broadcast()).max() > 0
    x = augmented.problem.server_data.x
    algorithm = augmented.coordinator.algorithm
    out = algorithm.augmented_transfer_set(x, 3, 9)
    generator = rng(9, Stream.SERVER, 3, 1)
    corners, flips = generator.integers(0, 9, size=(len(x), 2)), generator.random(len(x)) < 0.5
    for i in range(len(x)):
        fill = x.min(axis=(0, 2, 3))[:, None, None]
        padded = np.broadcast_to(fill, (3, 16, 16)).copy()
        padded[:, 4:12, 4:12] = x[i]
        top, left = corners[i]
        crop = padded[:, top : top + 8, left : left + 8]
        np.testing.assert_array_equal(out[i], crop[:, :, ::-1] if flips[i] else crop)
    assert not np.array_equal(out, x)


def test_augfl_runs_with_crds_batchnorm_resnets_for_client_and_teacher(tmp_path, monkeypatch):
    """resnet8x4_bn on the clients distils from resnet32x4_bn (its default teacher, as the authors built both), with
    the diagnostics: the round's metrics are finite, the teacher's pretraining pool is scored (accuracy in [0, 1]).
    AugFL's gradients are those of the network as scored (docs/usage.md, Running statistics): no step writes batch
    statistics, so the running statistics keep their initial values (mean 0, variance 1) in theta and every theta_i."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    algorithm = {
        "name": "augfl",
        "alpha": 0.05,
        "rho": 2.0,  # a step 1/(m rho) = 1/8 that 4 clients keep stable for two rounds
        "lambda": 1.0,
        "regularizer": "crd",
        "teacher_epochs": 1,
        "transfer": {"negatives": 16},
        "diagnostics": True,
    }
    config = tiny_config(
        algorithm=algorithm,
        dataset={"name": "npz", "path": str(_images(tmp_path))},
        partition={**META, "val_fraction": 0.0, "reserved": 200, "server_samples": 128},
        model={"name": "resnet8x4_bn"},
        clients={"count": 4},
    )
    sim = InProcess(validate_config(config))
    assert sim.problem.server_data.pretrained_model == "resnet32x4_bn"
    teacher = FlatModel("resnet32x4_bn", (3, 8, 8), 10)
    assert sim.problem.server_data.pretrained.size == teacher.size and teacher.has_statistics
    logged = [_round(sim, r) for r in range(2)]
    assert all(np.isfinite(v) for m in logged for v in m.values())
    assert 0 <= logged[-1]["server/pretrain_acc"] <= 1 and logged[-1]["server/lagrangian"] > 0
    statistics = sim.host.model.spec.statistics_mask()
    init = sim.problem.init_params
    np.testing.assert_array_equal(sim.coordinator.broadcast()[statistics], init[statistics])
    for state in sim.states.values():
        np.testing.assert_array_equal(state.theta[statistics], init[statistics])


def test_heldout_accuracy_weighted_by_query_size():
    """`heldout/{pm,gm}/acc_weighted` is sum_i n_i acc_i / sum_i n_i over the held-out clients with n_i their test
    (query) samples, the authors' target_test2; `heldout/pm/acc` stays the unweighted mean; training clients and
    their sizes do not enter either."""
    from raysim.evaluation.columns import evaluation_batch
    from raysim.evaluation.records import ClientEvaluation, ModelScores
    from raysim.evaluation.summaries import benign_summary

    accuracies = {0: (0.9, 0.1), 1: (0.5, 0.5), 2: (1.0, 0.25), 3: (0.25, 1.0)}  # client: (pm, gm)
    table = evaluation_batch(
        [
            ClientEvaluation(c, ModelScores(pm, 1.0, 1.0), ModelScores(gm, 1.0, 1.0))
            for c, (pm, gm) in accuracies.items()
        ]
    )
    sizes = {2: 30, 3: 10}
    summary = benign_summary(table, frozenset(), frozenset({2, 3}), sizes)
    assert summary["heldout/pm/acc_weighted"] == pytest.approx((30 * 1.0 + 10 * 0.25) / 40)
    assert summary["heldout/gm/acc_weighted"] == pytest.approx((30 * 0.25 + 10 * 1.0) / 40)
    assert summary["heldout/pm/acc"] == pytest.approx((1.0 + 0.25) / 2)
    assert summary["pm/acc"] == pytest.approx(0.7) and "pm/acc_weighted" not in summary
    assert "heldout/pm/acc_weighted" not in benign_summary(table, frozenset(), frozenset({2, 3}))
