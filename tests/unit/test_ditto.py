"""Ditto's global copy as the FLAME authors' code trains it: `global_steps: one_batch` (flame.md 2.4, 11); the
copy's rule against their update.py itself, batch for batch, is in tests/unit/test_authors_batches.py.

On the convex problem of tests/unit/test_baselines.py (f_i(theta) = 1/(2N) ||X_i theta - y_i||^2 with X_i^T X_i = N b_i
I, so grad f_i(theta) = b_i (theta - th_i)) every step has a closed form.
"""

from __future__ import annotations

import numpy as np
import torch

from raysim.algorithms.requests import LocalSGD
from raysim.config import validate_config
from raysim.models.flat import FlatModel
from raysim.training.local import ClientData, LocalTrainer
from raysim.training.vectorized import VectorizedTrainer
from tests.support.convex import orthogonal_regression
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

B, N, D = [1.0, 2.0, 3.0], 40, 4


def _sim(**algorithm) -> tuple[InProcess, np.ndarray]:
    problem, theta_hat = orthogonal_regression(B, N, D, seed=5)
    settings = {"name": "ditto", "lambda": 1.0, "lr": 0.1, "batch_size": N, "epochs": 1} | algorithm
    config = validate_config(tiny_config(algorithm=settings, clients={"count": 3}, model={"name": "linear"}))
    return InProcess(config, problem), theta_hat


def test_one_batch_moves_the_copy_by_exactly_one_plain_gradient_step():
    """Batch >= the split: the one batch is the whole split, so after round 1 the never-resynced copy is
    w0 - eta_g b_i (w0 - th_i), whatever momentum and weight decay the personal model uses."""
    sim, theta_hat = _sim(global_resync=False, global_steps="one_batch", global_lr=0.3, momentum=0.5, weight_decay=0.01)
    w0 = sim.problem.init_params.astype(np.float64)
    sim.round(0)
    for i, state in sim.states.items():
        train = len(sim.problem.clients[i][1].train)
        assert train <= N
        expected = w0 - 0.3 * B[i] * (w0 - theta_hat[i]) if train == N else None
        if expected is not None:
            np.testing.assert_allclose(state.w, expected, atol=1e-5)
    second = {i: s.w.astype(np.float64) for i, s in sim.states.items()}
    sim.round(1)  # from its own copy, not from the received mean (global_resync: false)
    for i, state in sim.states.items():
        if len(sim.problem.clients[i][1].train) == N:
            np.testing.assert_allclose(state.w, second[i] - 0.3 * B[i] * (second[i] - theta_hat[i]), atol=1e-5)


def test_one_batch_at_h1_ignores_momentum_and_weight_decay_but_the_personal_model_does_not():
    """At H = 1 the copy's one step starts from an empty momentum buffer and has no weight decay; the personal
    model's 4 steps (batches of 10 of 40 samples) use both."""
    plain, _ = _sim(global_resync=False, global_steps="one_batch", batch_size=10)
    heavy, _ = _sim(global_resync=False, global_steps="one_batch", batch_size=10, momentum=0.5, weight_decay=0.5)
    for sim in (plain, heavy):
        sim.round(0)
    for i in plain.states:
        np.testing.assert_array_equal(plain.states[i].w, heavy.states[i].w)
        assert not np.allclose(plain.states[i].v, heavy.states[i].v)


def test_one_batch_at_h2_takes_two_momentum_steps_after_each_epoch_from_an_empty_buffer():
    """Their update_weights at H = 2: after each of the 2 personal epochs a new SGD(lr=eta, momentum) takes 2 steps
    on the copy, so 4 steps a round, the buffer emptied after the second; no weight decay (here the one batch is the
    whole split: every step's gradient is b_i (w - th_i))."""
    eta, momentum = 0.2, 0.5
    sim, theta_hat = _sim(
        global_resync=False, global_steps="one_batch", global_lr=eta, momentum=momentum, weight_decay=0.3, epochs=2
    )
    w = sim.problem.init_params.astype(np.float64)
    sim.round(0)
    for i, state in sim.states.items():
        if len(sim.problem.clients[i][1].train) != N:
            continue
        expected = w.copy()
        for _epoch in range(2):
            velocity = np.zeros_like(expected)
            for _step in range(2):
                velocity = momentum * velocity + B[i] * (expected - theta_hat[i])
                expected = expected - eta * velocity
        np.testing.assert_allclose(state.w, expected, atol=1e-5)


def test_epoch_mode_is_unchanged_and_differs_from_one_batch():
    """`epoch` (Ditto's paper, the default) trains the copy like the personal model: with batches of 10 of the 40
    samples, its one epoch is 4 steps and moves the copy further towards th_i than one_batch's one step."""
    epoch, theta_hat = _sim(global_resync=False, batch_size=10)
    one, _ = _sim(global_resync=False, global_steps="one_batch", batch_size=10)
    for sim in (epoch, one):
        sim.round(0)
    for i in epoch.states:
        assert np.linalg.norm(epoch.states[i].w - theta_hat[i]) < np.linalg.norm(one.states[i].w - theta_hat[i])


def _client(n: int = 50, seed: int = 0) -> tuple[FlatModel, ClientData]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = rng.integers(0, 3, n).astype(np.int64)
    model = FlatModel("mlr", (6,), 3, "classification")
    return model, ClientData(x, y, np.arange(n), np.arange(0), np.arange(0))


def test_random_batches_take_one_batch_of_a_fresh_shuffle_per_step_the_short_last_one_included():
    """By hand: each step shuffles the split (the generator's permutation), picks one of its ceil(50/16) = 4
    batches uniformly (the generator's next integer; the 4th holds 2 samples) and steps on the mean cross-entropy
    over it, momentum carried over (torch autograd and torch.optim.SGD, independent of the trainer)."""
    model, data = _client()
    start = np.random.default_rng(1).standard_normal(model.size).astype(np.float32) * 0.1
    request = LocalSGD(start=start, epochs=3, lr=0.5, batch_size=16, momentum=0.5, random_batches=12)
    result = LocalTrainer(model).sgd(request, data, np.random.default_rng(42))
    weights = torch.tensor(start, requires_grad=True)
    optimizer = torch.optim.SGD([weights], lr=0.5, momentum=0.5)
    generator, sizes = np.random.default_rng(42), []
    for _step in range(12):
        order, pick = generator.permutation(50), int(generator.integers(4))
        batch = data.train[order[pick * 16 : (pick + 1) * 16]]
        sizes.append(len(batch))
        optimizer.zero_grad()
        logits = torch.from_numpy(data.x[batch]) @ weights[:18].reshape(3, 6).T + weights[18:]
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(data.y[batch])).backward()
        optimizer.step()
    assert 2 in sizes and 16 in sizes  # this seed draws the short last batch too
    np.testing.assert_allclose(result.params, weights.detach().numpy(), atol=1e-5)
    assert result.steps == 12


def test_vectorized_trainer_takes_the_same_random_batches_as_the_sequential_one():
    model, data = _client()
    start = np.zeros(model.size, np.float32)
    jobs = [(LocalSGD(start=start, epochs=1, lr=0.1, batch_size=8, random_batches=s), data) for s in (1, 3)]
    sequential = [LocalTrainer(model).sgd(r, d, np.random.default_rng(7)) for r, d in jobs]
    vectorized = VectorizedTrainer(model, chunk=4).sgd([(r, d, np.random.default_rng(7)) for r, d in jobs])
    for a, b in zip(sequential, vectorized, strict=True):
        np.testing.assert_array_equal(a.params, b.params)
        assert a.steps == b.steps
    assert [r.steps for r in sequential] == [1, 3]


def test_sequential_and_vectorized_ditto_runs_agree_with_one_batch():
    states = []
    for training in ("sequential", "vectorized"):
        config = validate_config(
            tiny_config(
                algorithm={
                    "name": "ditto",
                    "lr": 0.05,
                    "batch_size": 16,
                    "global_resync": False,
                    "global_steps": "one_batch",
                    "momentum": 0.5,
                },
                runtime={"num_hosts": 1, "client_training": training},
            )
        )
        sim = InProcess(config)
        for round_index in range(3):
            sim.round(round_index)
        states.append(sim.states)
    for i in states[0]:
        np.testing.assert_allclose(states[0][i].w, states[1][i].w, atol=1e-6)
        np.testing.assert_allclose(states[0][i].v, states[1][i].v, atol=1e-5)


def test_never_resynced_copies_stay_together_with_one_batch_and_drift_apart_with_an_epoch():
    """Fashion-MNIST, #label = 2, 10 clients, 3 rounds: the spread of the copies around their mean (the GM)."""
    spreads = {}
    for steps in ("epoch", "one_batch"):
        config = validate_config(
            {
                "algorithm": {
                    "name": "ditto",
                    "lr": 0.01,
                    "global_lr": 0.1,
                    "global_resync": False,
                    "global_steps": steps,
                    "batch_size": 100,
                },
                "partition": {"scheme": "q_label", "q": 2},
                "clients": {"count": 10},
            }
        )
        sim = InProcess(config)
        for round_index in range(3):
            sim.round(round_index)
        copies = np.stack([s.w for s in sim.states.values()])
        spreads[steps] = float(np.linalg.norm(copies - copies.mean(0), axis=1).mean())
    assert spreads["one_batch"] * 2 < spreads["epoch"], spreads  # measured: 0.66 vs 1.91
