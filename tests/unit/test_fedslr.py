"""FedSLR's mathematics (fedslr.md 2-3): the proximal operators, the FedDyn special case, the dual invariant
(eq. 25), the stationary point of (P1) on a convex problem, the factored downlink, and a CLI run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from raysim.algorithms import ClientInfo
from raysim.algorithms.families.lowrank import LowRankUpload
from raysim.algorithms.fedslr import FedSlr, FedSlrSettings
from raysim.algorithms.prox import dematrixize, layerwise_svt, matrixize, soft_threshold, svt
from raysim.algorithms.requests import LocalSGD, SGDResult
from raysim.algorithms.terms import L1, Offset
from raysim.config import validate_config
from raysim.evaluation.batched import Scorer
from raysim.evaluation.columns import ClientRecords, client_evaluations
from raysim.evaluation.summaries import mean_client_metrics, summarize
from raysim.execution import run_client_step
from raysim.models.flat import FlatModel
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.problem import prepare
from raysim.training.local import ClientData, LocalTrainer
from tests.support.convex import SPEC, Quadratic
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess, make_host


def test_soft_threshold_is_the_prox_of_the_l1_norm():
    """S_a(x) = argmin_z 1/2 (z - x)^2 + a |z|, checked against a brute-force minimization on a fine grid."""
    x = np.linspace(-2.0, 2.0, 41)
    grid = np.linspace(-3.0, 3.0, 60001)
    for a in (0.0, 0.3, 1.1):
        brute = np.array([grid[np.argmin(0.5 * (grid - xi) ** 2 + a * np.abs(grid))] for xi in x])
        np.testing.assert_allclose(soft_threshold(x, a), brute, atol=1e-4)
        np.testing.assert_allclose(soft_threshold(torch.from_numpy(x), a).numpy(), brute, atol=1e-4)


def test_svt_equals_the_nuclear_prox_found_by_another_route():
    """Prox_{t||.||_*}(X) against the minimizer of 1/2||UV^T - X||^2 + t/2 (||U||^2 + ||V||^2), whose minimum
    over factorizations is the nuclear-norm prox (the variational form of ||Z||_*), found by L-BFGS."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    t = 0.8
    u = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([u, v], max_iter=5000, tolerance_grad=1e-12, tolerance_change=1e-15)

    def closure():
        optimizer.zero_grad()
        loss = 0.5 * ((u @ v.T - x) ** 2).sum() + 0.5 * t * ((u**2).sum() + (v**2).sum())
        loss.backward()
        return loss

    for _ in range(5):
        optimizer.step(closure)
    prox = svt(x, t)
    np.testing.assert_allclose(prox.matrix().numpy(), (u @ v.T).detach().numpy(), atol=1e-5)
    objective = lambda z: 0.5 * ((z - x) ** 2).sum() + t * torch.linalg.svdvals(z).sum()  # noqa: E731
    best = objective(prox.matrix())
    for _ in range(20):
        assert objective(prox.matrix() + 1e-3 * torch.randn(6, 4, generator=generator, dtype=torch.float64)) > best


def test_svt_is_identity_at_zero_and_rank_shrinks_as_the_threshold_grows():
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    identity = svt(x, 0.0)
    assert identity.rank == 5
    np.testing.assert_allclose(identity.matrix().numpy(), x.numpy(), atol=1e-12)
    singular = torch.linalg.svdvals(x)
    ranks = [svt(x, t).rank for t in np.linspace(0.0, float(singular[0]) * 1.01, 30)]
    assert ranks == sorted(ranks, reverse=True) and ranks[-1] == 0
    for t in (0.5, 1.5):
        assert svt(x, t).rank == int((singular > t).sum())
        kept = svt(x, t)
        np.testing.assert_allclose(torch.linalg.svdvals(kept.matrix())[: kept.rank], singular[singular > t] - t)


def test_conv_matrixization_layout_and_exact_round_trip():
    """pi: [o,i,kh,kw] -> (o*kh) x (i*kw) with rows (out, kernel row), columns (in, kernel col) (fedslr.md 1.2)."""
    w = torch.randn(5, 3, 2, 4)
    m = matrixize(w)
    assert m.shape == (10, 12)
    for o, i, r, c in [(0, 0, 0, 0), (4, 2, 1, 3), (2, 1, 0, 2)]:
        assert m[o * 2 + r, i * 4 + c] == w[o, i, r, c]
    assert torch.equal(dematrixize(m, tuple(w.shape)), w)
    linear = torch.randn(4, 7)
    assert torch.equal(dematrixize(matrixize(linear), (4, 7)), linear)
    conv1d = torch.randn(5, 3, 2)  # a 1-D conv [o, i, k] is the 2-D conv [o, i, k, 1]
    assert torch.equal(matrixize(conv1d), matrixize(conv1d[..., None]))
    assert torch.equal(dematrixize(matrixize(conv1d), (5, 3, 2)), conv1d)
    with pytest.raises(ValueError, match="matrix form"):
        matrixize(torch.randn(2, 3, 4, 5, 6))


def test_layerwise_svt_thresholds_matrices_and_leaves_1d_parameters_alone():
    flat = np.random.default_rng(2).normal(size=SPEC.size).astype(np.float32)
    result = layerwise_svt(flat, SPEC, 0.7)
    assert set(result.ranks) == {"conv", "fc"}
    np.testing.assert_array_equal(result.params[SPEC.slice("bias")], flat[SPEC.slice("bias")])
    conv = torch.from_numpy(flat[SPEC.slice("conv")]).view(3, 2, 2, 2)
    expected = dematrixize(svt(matrixize(conv), 0.7).matrix(), (3, 2, 2, 2))
    np.testing.assert_allclose(result.params[SPEC.slice("conv")], expected.reshape(-1).numpy(), atol=1e-6)
    assert layerwise_svt(flat, SPEC, 1e6).ranks == {"conv": 0, "fc": 0}
    np.testing.assert_array_equal(layerwise_svt(flat, SPEC, 0.0).params, flat)  # float64 SVD round-trips float32


def _trainer_and_data(seed: int = 0) -> tuple[LocalTrainer, ClientData]:
    generator = np.random.default_rng(seed)
    x = generator.normal(size=(40, 6)).astype(np.float32)
    y = generator.integers(0, 3, size=40)
    return LocalTrainer(FlatModel("mlr", (6,), 3)), ClientData(x, y, np.arange(40), np.arange(0), np.arange(0))


def test_local_sgd_offset_evaluates_the_loss_at_offset_plus_x():
    """SGD on f(o + x) from x0 is SGD on f from o + x0, shifted by -o (same batches)."""
    trainer, data = _trainer_and_data()
    size = trainer.model.size
    start, offset = np.full(size, 0.1, np.float32), np.random.default_rng(3).normal(size=size).astype(np.float32)
    shifted = trainer.sgd(LocalSGD(start, 2, 0.1, 8, terms=(Offset(offset),)), data, np.random.default_rng(5))
    plain = trainer.sgd(LocalSGD(offset + start, 2, 0.1, 8), data, np.random.default_rng(5))
    np.testing.assert_allclose(shifted.params + offset, plain.params, atol=1e-5)
    assert shifted.mean_loss == pytest.approx(plain.mean_loss, rel=1e-5)


def test_local_sgd_l1_is_proximal_sgd():
    """Each step is x <- S_{lr*l1}(x - lr grad); one full-batch step checks it, a large l1 zeroes everything."""
    trainer, data = _trainer_and_data()
    size = trainer.model.size
    start = np.random.default_rng(4).normal(size=size).astype(np.float32)
    _, grad = trainer.model.loss_and_grad(torch.from_numpy(start), torch.from_numpy(data.x), torch.from_numpy(data.y))
    step = trainer.sgd(LocalSGD(start, 1, 0.5, 40, terms=(L1(0.4),)), data, np.random.default_rng(0))
    np.testing.assert_allclose(step.params, soft_threshold(start - 0.5 * grad.numpy(), 0.2), atol=1e-6)
    assert not np.any(
        trainer.sgd(LocalSGD(start, 1, 0.5, 8, terms=(L1(100.0),)), data, np.random.default_rng(0)).params
    )
    per_entry = np.zeros(size, np.float32)
    kept = trainer.sgd(LocalSGD(start, 1, 0.5, 40, terms=(L1(per_entry),)), data, np.random.default_rng(0))
    np.testing.assert_allclose(kept.params, start - 0.5 * grad.numpy(), atol=1e-6)


def _round(algorithm, problem: Quadratic, server, states: dict, selected: list[int], m: int):
    broadcast = algorithm.broadcast(server)
    total = None
    for i in selected:
        info = ClientInfo(i, 10, 1.0 / m, m)
        update = run_client_step(algorithm, info, states[i], broadcast, problem.executor(i))
        states[i] = update.state
        total = update.upload.w.astype(np.float64) if total is None else total + update.upload.w
    return algorithm.server_step(server, LowRankUpload(total, float(len(selected))), len(selected))


def test_lambda_mu_zero_is_feddyn():
    """With lambda = mu = 0, FedSLR's w_t is FedDyn's theta_t (alpha = 1/eta_g, fedslr.md 2.2, 2.8), under
    partial participation; FedDyn is written out here from its own paper's equations."""
    m, size, eta_g = 5, SPEC.size, 0.7
    problem = Quadratic(m, size, seed=6)
    algorithm = FedSlr(FedSlrSettings(**{"lambda": 0.0, "mu": 0.0, "eta_g": eta_g}), SPEC)
    w0 = np.random.default_rng(7).normal(size=size).astype(np.float32)
    server = algorithm.init_server(w0, m)
    states = {i: algorithm.init_client(ClientInfo(i, 10, 1 / m, m), w0) for i in range(m)}
    alpha, theta, h = 1.0 / eta_g, w0.astype(np.float64), np.zeros(size)
    grads = np.zeros((m, size))  # FedDyn's nabla L_i
    generator = np.random.default_rng(8)
    for _ in range(12):
        selected = sorted(generator.choice(m, 3, replace=False))
        server, _ = _round(algorithm, problem, server, states, selected, m)
        local = {}
        for i in selected:  # argmin L_i(x) - <grad L_i, x> + alpha/2 ||x - theta||^2
            local[i] = (problem.h[i] * problem.a[i] + grads[i] + alpha * theta) / (problem.h[i] + alpha)
            grads[i] -= alpha * (local[i] - theta)
        h -= alpha / m * sum(local[i] - theta for i in selected)
        theta = np.mean([local[i] for i in selected], axis=0) - h / alpha
        np.testing.assert_allclose(server.w, theta, atol=1e-4)
        np.testing.assert_allclose(server.gamma_mean, h, atol=1e-5)
    for i in range(m):
        np.testing.assert_allclose(states[i].gamma, grads[i], atol=1e-4)


def test_duals_record_local_gradients_and_the_server_mirror_matches():
    """Eq. 25: gamma_i = grad f_i(w_i) after an exact Phase I; the server's mean equals the clients' mean; Phase II
    gives p_i = S_{mu/h_i}(a_i - w_t), the exact prox-solution around the received w_t."""
    m = 4
    problem = Quadratic(m, SPEC.size, seed=9)
    algorithm = FedSlr(FedSlrSettings(**{"lambda": 0.05, "mu": 0.3, "eta_g": 0.4}), SPEC)
    w0 = np.zeros(SPEC.size, np.float32)
    server = algorithm.init_server(w0, m)
    states = {i: algorithm.init_client(ClientInfo(i, 10, 1 / m, m), w0) for i in range(m)}
    for selected in ([0, 1], [1, 2, 3], [0, 3]):
        w_t = server.w.copy()
        previous = {i: states[i].gamma.copy() for i in selected}
        server, _ = _round(algorithm, problem, server, states, selected, m)
        for i in selected:
            w_i = w_t + algorithm.settings.eta_g * (previous[i] - states[i].gamma)  # invert eq. 5
            np.testing.assert_allclose(states[i].gamma, problem.grad(i, w_i), atol=1e-4)
            np.testing.assert_allclose(states[i].p, soft_threshold(problem.a[i] - w_t, 0.3 / problem.h[i]), atol=1e-5)
            np.testing.assert_array_equal(states[i].w, w_t)
        np.testing.assert_allclose(server.gamma_mean, np.mean([s.gamma for s in states.values()], axis=0), atol=1e-6)


def test_full_participation_converges_to_a_stationary_point_of_p1():
    """Eq. 9 on a convex problem: at the limit w*, G = (1/lambda) (1/M) sum_i -grad f_i(w*) restricted to each matrix
    is a subgradient of ||W||_* at W*: <G, W*> = ||W*||_* and ||G||_2 <= 1; 1-D entries have zero gradient."""
    m, lam = 4, 0.8
    problem = Quadratic(m, SPEC.size, seed=10)
    eta_g = 1.0 / (2 * problem.h.max())  # the theory's step bound 1/(2L)
    algorithm = FedSlr(FedSlrSettings(**{"lambda": lam, "mu": 0.0, "eta_g": eta_g}), SPEC)
    w0 = np.zeros(SPEC.size, np.float32)
    server = algorithm.init_server(w0, m)
    states = {i: algorithm.init_client(ClientInfo(i, 10, 1 / m, m), w0) for i in range(m)}
    for _ in range(400):
        server, metrics = _round(algorithm, problem, server, states, list(range(m)), m)
    w = server.w.astype(np.float64)
    gradient = np.mean([problem.grad(i, w) for i in range(m)], axis=0)
    np.testing.assert_allclose(gradient[SPEC.slice("bias")], 0.0, atol=1e-4)
    for name, shape in (("conv", (3, 2, 2, 2)), ("fc", (4, 5))):
        g = matrixize(torch.from_numpy(-gradient[SPEC.slice(name)] / lam).view(shape))
        weight = matrixize(torch.from_numpy(w[SPEC.slice(name)]).view(shape))
        assert float((g * weight).sum()) == pytest.approx(float(torch.linalg.svdvals(weight).sum()), abs=1e-4)
        assert float(torch.linalg.matrix_norm(g, ord=2)) <= 1 + 1e-4
    assert 0 < metrics["rank/conv"] < 4 or 0 < metrics["rank/fc"] < 4  # the penalty is active


def test_downlink_is_the_svd_factors_where_smaller_and_clients_rebuild_the_servers_model_exactly():
    """fedslr.md 2.4: a low-rank layer travels as U sqrt(S), sqrt(S) V^T of the server's own SVD when that is
    smaller than dense; the client's rebuilt w_t is bit for bit the server's GKR."""
    generator = np.random.default_rng(11)
    conv = np.outer(generator.normal(size=6), generator.normal(size=4))  # rank 1 as a 6 x 4 matrix
    fc = generator.normal(size=(4, 3)) @ generator.normal(size=(3, 5))  # rank 3
    flat = np.zeros(SPEC.size, dtype=np.float32)
    flat[SPEC.slice("conv")] = dematrixize(torch.from_numpy(conv), (3, 2, 2, 2)).reshape(-1).numpy()
    flat[SPEC.slice("fc")] = fc.reshape(-1)
    flat[SPEC.slice("bias")] = generator.normal(size=4)
    algorithm = FedSlr(FedSlrSettings(**{"lambda": 1e-6, "eta_g": 1.0}), SPEC)
    server = algorithm.init_server(flat, 2)
    assert algorithm.downlink_bytes(algorithm.broadcast(server)) == 4 * (SPEC.size + 1)  # w_0 dense
    prox = layerwise_svt(flat, SPEC, 1e-6)
    assert prox.ranks == {"conv": 1, "fc": 3}
    assert set(prox.model.factors) == {"conv"}  # conv 6x4 at rank 1: 10 < 24; fc 4x5 at rank 3: 27 > 20 dense
    server = dataclasses.replace(server, w=prox.params, model=prox.model, ranks=prox.ranks)
    broadcast = algorithm.broadcast(server)
    assert algorithm.downlink_bytes(broadcast) == 4 * (10 + 20 + 4 + 1)
    assert broadcast.model.params(SPEC).tobytes() == algorithm.global_model(server).tobytes()
    np.testing.assert_allclose(prox.params, flat, atol=1e-5)  # the threshold removed (almost) nothing
    assert algorithm.global_parameter_count({"conv": 0, "fc": 0}) == 4


def test_p_init_and_l1_scope_switches():
    w0 = np.random.default_rng(12).normal(size=SPEC.size).astype(np.float32)
    info = ClientInfo(0, 10, 0.5, 2)
    assert not FedSlr(FedSlrSettings(), SPEC).init_client(info, w0).p.any()
    p = FedSlr(FedSlrSettings(p_init="init"), SPEC).init_client(info, w0).p
    np.testing.assert_array_equal(p[:44], w0[:44])
    assert not p[SPEC.slice("bias")].any()
    algorithm = FedSlr(FedSlrSettings(mu=0.5, l1_scope="matrices"), SPEC)
    broadcast = algorithm.broadcast(algorithm.init_server(w0, 2))
    step = algorithm.client_step(info, algorithm.init_client(info, w0), broadcast)
    next(step)
    phase2 = step.send(SGDResult(w0, 0.0, 1))
    l1 = phase2.term(L1)
    assert phase2.term(Offset) is not None and l1 is not None
    assert np.array_equal(l1.weight, np.r_[np.full(44, 0.5), np.zeros(4)])


def test_p_init_copies_every_conv_and_linear_weight_and_bias_and_zeroes_normalization():
    """The authors' MaskedConv/MaskedLinear start p = copy(w) and p_bias = copy(bias); MaskedGroupNorm starts both
    of its p at zero (fedslr.md 2.5). On the real CNN (convs and linears with biases) and on ResNet-18-GN's layout
    (convs without bias, GroupNorm weight and bias, a bias-free last layer)."""
    from raysim.models.spec import ParamSpec

    info = ClientInfo(0, 10, 0.5, 2)
    for model in (FlatModel("cnn", (1, 28, 28), 10), FlatModel("resnet18_gn", (3, 32, 32), 10)):
        spec = model.spec
        layers = {  # decided by the torch modules themselves, not by the parameters' shapes
            f"{name}.{part}"
            for name, module in model.module.named_modules()
            if isinstance(module, torch.nn.Conv2d | torch.nn.Linear)
            for part in ("weight", "bias")
            if getattr(module, part) is not None
        }
        w0 = np.random.default_rng(3).normal(size=spec.size).astype(np.float32)
        p = FedSlr(FedSlrSettings(p_init="init"), spec).init_client(info, w0).p
        for name in spec.names:
            np.testing.assert_array_equal(p[spec.slice(name)], w0[spec.slice(name)] if name in layers else 0.0, name)
        biases = {name for name in layers if name.endswith(".bias")}
        assert bool(biases) == (spec.model == "cnn")  # the CNN's layers carry biases, ResNet-18-GN's none
    hand = ParamSpec(("c.weight", "c.bias", "n.weight", "n.bias"), ((2, 3), (2,), (2,), (2,)), (0, 6, 8, 10))
    w0 = np.arange(1, 13, dtype=np.float32)
    p = FedSlr(FedSlrSettings(p_init="init"), hand).init_client(info, w0).p
    np.testing.assert_array_equal(p, np.r_[w0[:8], np.zeros(4)])  # no `normalization` recorded: 1-D weight decides


def _fedslr_host_after_one_round(algorithm: dict):
    config = validate_config(tiny_config(algorithm=algorithm))
    problem = prepare(config)
    host = make_host(config, problem)
    coordinator = Coordinator(
        CoordinatorSettings(config.algorithm, problem.params, config.clients.count), problem.init_params
    )
    broadcast = coordinator.broadcast()
    _, records = host.train(0, host.client_ids, broadcast)
    return problem, host, broadcast, records


def test_personal_only_accuracy_is_p_i_alone_scored_on_the_clients_test_split():
    """`personal/acc` (Algorithm.extra_models) is the mean over clients of the test accuracy of p_i by itself,
    next to PM = w + p_i and GM = w; algorithms without extra models log no such keys."""
    settings = {"name": "fedslr", "lambda": 0.05, "eta_g": 10.0, "mu": 1e-4, "lr": 0.1, "batch_size": 32}
    problem, host, broadcast, _ = _fedslr_host_after_one_round(settings)
    w = broadcast.model.params(host.model.spec)
    table = host.evaluate(w)
    evaluations = client_evaluations(table)
    accuracies = []
    for (info, split), evaluation in zip(problem.clients, evaluations, strict=True):
        p = host.client_states()[info.id].p
        assert np.count_nonzero(p) > 0
        x_test, y_test = problem.x[split.test], problem.y[split.test]
        loss, acc = Scorer(host.model).evaluate(p, x_test, y_test)
        assert evaluation.extra["personal"].test_acc == acc and evaluation.extra["personal"].test_loss == loss
        assert evaluation.pm.test_acc == Scorer(host.model).evaluate(w + p, x_test, y_test)[1]
        accuracies.append(acc)
    summary = summarize(table)
    assert summary["personal/acc"] == pytest.approx(np.mean(accuracies))
    assert summary["personal/acc_std"] == pytest.approx(np.std(accuracies, ddof=1))
    assert evaluations[0].row()["personal_test_acc"] == accuracies[0]
    _, plain, broadcast, _ = _fedslr_host_after_one_round({"name": "fedavg", "lr": 0.1, "batch_size": 32})
    assert not any(k.startswith("personal/") for k in summarize(plain.evaluate(broadcast)))


def test_mixed_parameter_count_is_the_gkr_count_plus_the_nonzeros_of_p_and_spread_is_logged():
    """fedslr.md 6.5: #params(mixed) = sum_l min(d1 d2, r (d1 + d2)) + 1-D params + nnz(p_i), with the std of
    nnz(p_i) over the selected clients (Table 4 reports mean +- std)."""
    settings = {"name": "fedslr", "lambda": 0.05, "eta_g": 10.0, "mu": 1e-3, "lr": 0.1, "batch_size": 32}
    problem, host, broadcast, records = _fedslr_host_after_one_round(settings)
    gkr = host.algorithm.global_parameter_count(broadcast.ranks)
    nonzeros = [float(np.count_nonzero(host.client_states()[c].p)) for c in records["client_id"].to_pylist()]
    assert records["mixed_params"].to_pylist() == [gkr + n for n in nonzeros]
    logged = mean_client_metrics(records)
    assert logged["update/p_nonzeros"] == pytest.approx(np.mean(nonzeros))
    assert logged["update/p_nonzeros_std"] == pytest.approx(np.std(nonzeros, ddof=1)) and np.std(nonzeros) > 0
    one = ClientRecords()
    one.add([0], [0.0], {"a": np.array([2.0])})
    assert mean_client_metrics(one.batch()) == {"update/a": 2.0, "update/a_std": 0.0, "update/a_max": 2.0}


def _dual_form_run(server_duals: str, rounds: list[list[int]]):
    config = validate_config(
        tiny_config(
            algorithm={
                "name": "fedslr",
                "lambda": 0.05,
                "eta_g": 2.0,
                "mu": 1e-3,
                "lr": 0.05,
                "batch_size": 32,
                "server_duals": server_duals,
            },
        )
    )
    run = InProcess(config)
    iterates = []
    for round_index, selected in enumerate(rounds):
        run.round(round_index, selected)
        iterates.append(run.server.w.copy())
    return run, iterates


def test_per_client_dual_mirrors_and_the_running_mean_give_the_same_server_iterates():
    """Alg. 1/2 keep every client's gamma_i at the server and average all M of them; Alg. 3 keeps only that mean
    and moves it by (1/M) sum_i (w_t - w_i)/eta_g. With all clients taking part the two are the same sum written
    two ways (eq. 5 summed over i), so the server's pre-prox point, hence its SVT and the next w_t, agree (up to
    float32 rounding of the stored gamma_i; fedslr.md 2.8: "claimed identical to Alg. 1").

    Under partial participation Alg. 3 as printed (a mean over all M of w_t - w_i) is undefined for the clients
    that sent no w_i; its partial-participation form (fedslr.md 2.8 NOTE) adds the selected clients' changes only,
    still divided by M, because a non-participant's gamma_i is held fixed (Alg. 2: w averaged over S_t, gamma over
    all M, stale ones included). So the iterates agree there too; what differs is state and what it allows: M
    model-sized mirrors (4.47 GB for ResNet-18 at M = 100, fedslr.md 2.9) against one, per-client mirrors that can
    be checked against each client's own gamma_i (fedslr.md 10 item 5, checked below), and, under robust
    aggregation, mirrors moved by each client's own w_i instead of by the robust aggregate. Dividing the selected
    clients' changes by |S_t| instead of M would break the agreement."""
    rounds = [[0, 1, 2, 3], [0, 1, 2, 3], [1, 3], [0, 2, 3], [2]]
    per_client, per_client_iterates = _dual_form_run("per_client", rounds)
    running, running_iterates = _dual_form_run("running_mean", rounds)
    assert per_client.host.settings.send_messages and not running.host.settings.send_messages
    for a, b in zip(per_client_iterates, running_iterates, strict=True):
        assert np.abs(a).max() > 0.1
        np.testing.assert_allclose(a, b, atol=2e-6)
    mirrors, states = per_client.server.gammas, per_client.states
    for client in range(4):  # the server's mirror is bit for bit the client's own gamma_i
        np.testing.assert_array_equal(mirrors[client], states[client].gamma)
    np.testing.assert_allclose(per_client.server.gamma_mean, running.server.gamma_mean, atol=1e-6)
    np.testing.assert_allclose(running.server.gamma_mean, np.mean(mirrors, axis=0, dtype=np.float64), atol=1e-6)
    assert running.server.gammas is None


def _numpy_matrix(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """fedslr.md 1.2 scheme 2, written again with numpy: [o, i, kh, kw] -> (o kh) x (i kw); linear as is."""
    if len(shape) == 2:
        return values.reshape(shape)
    out, inp, kh, kw = shape
    return values.reshape(shape).swapaxes(1, 2).reshape(out * kh, inp * kw)


def test_nuclear_norm_metric_and_spectra_table_are_the_singular_values_found_independently():
    """`server/nuclear_norm` = sum_l ||W_l||_* of the new GKR and the `spectra` table holds every singular value of
    every matrix layer, both against numpy's SVD of the layers of the global model."""
    generator = np.random.default_rng(21)
    flat = generator.normal(size=SPEC.size)
    algorithm = FedSlr(FedSlrSettings(**{"lambda": 0.2, "eta_g": 1.0}), SPEC)
    server = algorithm.init_server(flat.astype(np.float32), 2)
    prox, metrics = algorithm.low_rank(flat, 0.2, server.w)
    singular = {
        name: np.linalg.svd(_numpy_matrix(prox.params[SPEC.slice(name)].astype(np.float64), shape), compute_uv=False)
        for name, shape in (("conv", (3, 2, 2, 2)), ("fc", (4, 5)))
    }
    assert metrics["nuclear_norm"] == pytest.approx(sum(s.sum() for s in singular.values()), rel=1e-6)
    before = {
        name: np.linalg.svd(_numpy_matrix(flat[SPEC.slice(name)], shape), compute_uv=False)
        for name, shape in (("conv", (3, 2, 2, 2)), ("fc", (4, 5)))
    }
    shrunk = sum(np.maximum(s - 0.2, 0).sum() for s in before.values())  # SVT shrinks each singular value by 0.2
    assert metrics["nuclear_norm"] == pytest.approx(shrunk, rel=1e-6) and shrunk < sum(s.sum() for s in before.values())
    table = algorithm.model_tables(prox.params)["spectra"]
    assert table["layer"] == ["conv"] * 4 + ["fc"] * 4 and table["index"] == [0, 1, 2, 3] * 2
    np.testing.assert_allclose(table["singular_value"], np.r_[singular["conv"], singular["fc"]], atol=1e-6)


def test_layer_sparsity_is_the_share_of_zeros_of_p_in_each_matrix_layer():
    p = np.ones(SPEC.size, np.float32)
    p[SPEC.slice("conv")][:6] = 0.0  # 6 of the conv kernel's 24 entries
    p[SPEC.slice("fc")] = 0.0
    p[SPEC.slice("bias")] = 0.0  # 1-D: not a layer of its own here (p_density counts it)
    sparsity = FedSlr(FedSlrSettings(), SPEC).layer_sparsity(p)
    assert sparsity == {"p_sparsity/conv": 0.25, "p_sparsity/fc": 1.0}
