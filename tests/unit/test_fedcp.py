"""FedCP (raysim.algorithms.fedcp; the gated heads of raysim.models.gated): the policy's invariants, the forward and
loss against a computation by hand, the special case that coincides with FedRep, the PM the hosts score, the state
whatever the number of hosts and through a checkpoint, and its communication accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms.fedcp import FedCPServerState, GatedHeadsLoss, mmd
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.models.composed import GatedHeads
from raysim.models.flat import FlatModel
from tests.support.experiments import tiny_config
from tests.support.features import CLASSES, DIM, labelled_problem
from tests.support.inprocess import InProcess, make_host
from tests.support.states import assert_identical

HEADS = GatedHeads()
FEATURES = 64
"""d: the features of tests.support.features' mlp (DIM-128-64-CLASSES)."""


def _vector(seed: int) -> tuple[FlatModel, torch.Tensor]:
    """The mlp's gated-heads model and a random vector of it (LayerNorm gamma around 1)."""
    model = FlatModel("mlp", (DIM,), CLASSES).composed(HEADS)
    vector = torch.from_numpy(np.random.default_rng(seed).normal(0.0, 0.3, model.spec.size).astype(np.float32))
    return model, vector


def _by_hand(model: FlatModel, vector: torch.Tensor, x: torch.Tensor, context: torch.Tensor | None = None):
    """GatedHeads' logits (raysim.models.composed) from the vector's named parts: (logits, features, s, r)."""
    p = model.spec.unflatten(vector)
    h = x
    for layer in ("1", "3"):  # the mlp's hidden layers (Flatten, Linear, ReLU, Linear, ReLU, head)
        h = torch.relu(h @ p[f"network.{layer}.weight"].T + p[f"network.{layer}.bias"])
    w_p, b_p = p["network.5.weight"], p["network.5.bias"]
    c = w_p.sum(dim=0) if context is None else context
    v = c / c.norm()
    z = (h * v) @ p["policy.0.weight"].T + p["policy.0.bias"]
    z = (z - z.mean(dim=1, keepdim=True)) / torch.sqrt(z.var(dim=1, unbiased=False, keepdim=True) + 1e-5)
    u = torch.relu(z * p["policy.1.weight"] + p["policy.1.bias"])
    s = torch.exp(u[:, :FEATURES]) / (torch.exp(u[:, :FEATURES]) + torch.exp(u[:, FEATURES:]))
    r = 1 - s
    logits = (h * s) @ w_p.T + b_p + (h * r) @ p["global_head.weight"].T + p["global_head.bias"]
    return logits, h, s, r


def test_the_vector_is_policy_then_network_then_global_head():
    """GatedHeads' layout, as the algorithm slices it: the CPN (2 d^2 + 6 d), the network, its head's shape again."""
    network = FlatModel("mlp", (DIM,), CLASSES)
    model = network.composed(HEADS)
    names = model.spec.names
    assert names[:4] == ("policy.0.weight", "policy.0.bias", "policy.1.weight", "policy.1.bias")
    assert names[4:-2] == tuple(f"network.{name}" for name in network.spec.names)
    assert names[-2:] == ("global_head.weight", "global_head.bias") == model.spec.head
    assert model.spec.size == HEADS.policy_size(FEATURES) + network.size + network.spec.head_size
    assert network.composed(HEADS) is model  # made once


def test_policy_entries_are_shares_and_the_two_parts_sum_to_the_feature():
    """Each entry of s and r is in [0, 1] and s + r = 1, so h * s + h * r = h: a global head in both places (and a
    zero personal bias) gives the plain network with that head, whatever the policy."""
    model, vector = _vector(0)
    x = np.random.default_rng(1).normal(size=(20, DIM)).astype(np.float32)
    shares = model.shares(vector.numpy(), x)
    assert shares.shape == (20, 2, FEATURES)
    assert shares.min() >= 0 and shares.max() <= 1 and shares.std() > 1e-3
    np.testing.assert_allclose(shares.sum(axis=1), 1.0, atol=1e-6)
    logits, h, s, r = _by_hand(model, vector, torch.from_numpy(x))
    torch.testing.assert_close(h * s + h * r, h, atol=1e-6, rtol=0)
    p = model.spec.unflatten(vector.clone())
    p["network.5.weight"].copy_(p["global_head.weight"])
    p["network.5.bias"].zero_()
    as_global = torch.cat([t.reshape(-1) for t in p.values()])
    plain = model.network.spec.unflatten(torch.zeros(model.network.size))
    for name in plain:
        plain[name].copy_(p[f"network.{name}"])
    network_vector = torch.cat([t.reshape(-1) for t in plain.values()])
    network_vector[-CLASSES * FEATURES - CLASSES :] = torch.cat(
        [p["global_head.weight"].reshape(-1), p["global_head.bias"]]
    )
    np.testing.assert_allclose(
        model.predict(as_global.numpy(), x), model.network.predict(network_vector.numpy(), x), atol=1e-5
    )


def test_forward_and_loss_are_the_papers_by_hand():
    """The scored logits (no noise, context from the personalized head) and the loss CE + lambda MMD^2 with a given
    context and no noise, value and gradient, against the formulas computed from the vector's parts."""
    model, vector = _vector(2)
    generator = np.random.default_rng(3)
    x = torch.from_numpy(generator.normal(size=(12, DIM)).astype(np.float32))
    y = torch.from_numpy(generator.integers(0, CLASSES, 12))
    expected, _h, _s, _r = _by_hand(model, vector, x)
    np.testing.assert_allclose(model.predict(vector.numpy(), x.numpy()), expected.numpy(), atol=1e-5)
    reference = generator.normal(0.0, 0.3, model.network.size).astype(np.float32)
    context = generator.normal(size=FEATURES).astype(np.float32)
    loss = GatedHeadsLoss(HEADS, context, reference, mmd_weight=5.0, gumbel=False)
    value, grad = loss.loss_and_grad(model.network, vector, x, y, None)
    point = vector.clone().requires_grad_(True)
    logits, h, _s, _r = _by_hand(model, point, x, torch.from_numpy(context))
    with torch.no_grad():
        h_ref, _ = model.network.features(torch.from_numpy(reference), x)
    total = torch.nn.functional.cross_entropy(logits, y) + 5.0 * _mmd_by_hand(h, h_ref)
    (expected_grad,) = torch.autograd.grad(total, point)
    assert value == pytest.approx(total.item(), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=2e-5, rtol=1e-4)
    global_head = slice(model.spec.size - CLASSES * (FEATURES + 1), model.spec.size)
    assert grad[global_head].abs().max() > 0  # frozen by the algorithm's mask, not by the loss


def _mmd_by_hand(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def kernel(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        squared = ((p[:, None, :] - q[None, :, :]) ** 2).sum(dim=-1)
        return sum(torch.exp(-squared / (2 * sigma)) for sigma in (10.0, 15.0, 20.0, 50.0))

    return kernel(a, a).mean() + kernel(b, b).mean() - 2 * kernel(a, b).mean()


def test_mmd_vanishes_between_equal_samples_and_grows_with_a_shift():
    x = torch.from_numpy(np.random.default_rng(4).normal(size=(10, 5)))
    assert mmd(x, x).item() == pytest.approx(0.0, abs=1e-12)
    assert 0 < mmd(x, x + 1).item() < mmd(x, x + 3).item()


def test_gumbel_noise_comes_from_the_steps_seed():
    """The same seed gives the same step; another seed another; without a seed a noisy loss is refused."""
    model, vector = _vector(5)
    x = torch.from_numpy(np.random.default_rng(6).normal(size=(8, DIM)).astype(np.float32))
    y = torch.zeros(8, dtype=torch.int64)
    loss = GatedHeadsLoss(HEADS, np.ones(FEATURES, np.float32))
    one, two, other = (loss.loss_and_grad(model.network, vector, x, y, seed) for seed in (7, 7, 8))
    assert one[0] == two[0] and torch.equal(one[1], two[1]) and one[0] != other[0]
    with pytest.raises(ValueError, match="seed"):
        loss.loss_and_grad(model.network, vector, x, y, None)


def _config(clients: int, **algorithm):
    settings = {"name": "fedcp", "lr": 0.1, "batch_size": 8, "epochs": 2, **algorithm}
    return validate_config(tiny_config(algorithm=settings, clients={"count": clients}, model={"name": "mlp"}))


def _forced_to_the_personal_head(sim: InProcess) -> None:
    """A CPN whose policy is s = 1 exactly for every sample (gamma 0, beta 1000 on the personalized half) and a
    global head without bias: the output is then the network with its personalized head."""
    algorithm = sim.coordinator.algorithm
    composite = algorithm.assemble(sim.states[0].personal_head, sim.coordinator.state.shared)
    d, policy = FEATURES, algorithm.policy.sum()
    composite[2 * d * d + 2 * d : 2 * d * d + 4 * d] = 0.0
    composite[2 * d * d + 4 * d : policy] = np.concatenate([np.full(d, 1000.0), np.zeros(d)])
    composite[-CLASSES:] = 0.0
    sim.coordinator.state = FedCPServerState(composite[algorithm.shared])


def test_a_policy_sending_everything_to_the_personalized_head_is_fedrep_trained_jointly():
    """s = 1: out = p_i(h), the CPN and the frozen global head get no gradient; with lambda = 0, no Gumbel draws and
    head_mix = 0 (the global head stays), each client trains body and personalized head together on plain CE from the
    received body, and the server averages the bodies by samples: FedRep with `phases: joint` (same batches)."""
    problem = labelled_problem(3, 6, seed=8, held=[[0, 1], [1, 2], [0, 1, 2]])
    cp = InProcess(_config(3, **{"lambda": 0.0, "gumbel": False, "head_mix": 0.0}), problem)
    rep = InProcess(
        validate_config(
            tiny_config(
                algorithm={
                    "name": "fedrep",
                    "lr": 0.1,
                    "batch_size": 8,
                    "epochs": 2,
                    "phases": "joint",
                    "aggregation": "samples",
                },
                clients={"count": 3},
                model={"name": "mlp"},
            )
        ),
        problem,
    )
    _forced_to_the_personal_head(cp)
    policy_before = cp.coordinator.state.shared[: cp.coordinator.algorithm.policy.sum()].copy()
    for round_index in range(2):
        cp.round(round_index)
        rep.round(round_index)
    algorithm = cp.coordinator.algorithm
    body = ~algorithm.network_head
    gm = algorithm.global_model(cp.coordinator.state)
    np.testing.assert_allclose(gm[body], rep.coordinator.state.shared, atol=1e-5)
    assert np.abs(gm[body] - problem.init_params[body]).max() > 1e-3
    for client in range(3):
        np.testing.assert_allclose(cp.states[client].personal_head, rep.states[client].personal, atol=1e-5)
    # the CPN got no gradient: its average over the clients is itself, to the exact sum's fixed-point resolution
    np.testing.assert_allclose(cp.coordinator.state.shared[: len(policy_before)], policy_before, rtol=0, atol=1e-9)


def test_the_pm_the_hosts_score_is_the_gated_model_of_the_current_server_state():
    """PM = current CPN, body and global head with the client's own personalized head, scored with the noiseless
    policy; GM = body + global head; after a round they differ, and the PM logits are the gated formula's."""
    problem = labelled_problem(2, 6, seed=9, held=[[0, 1], [1, 2]])
    sim = InProcess(_config(2), problem)
    sim.round(0)
    algorithm = sim.coordinator.algorithm
    context = sim.coordinator.evaluation_context()
    gm = sim.coordinator.global_model()
    pm = algorithm.composed_model(sim.states[1], gm, context)
    model = problem.model_spec.build().composed(algorithm.personalized_network())
    expected, *_ = _by_hand(model, torch.from_numpy(pm), torch.from_numpy(problem.x[:7]))
    np.testing.assert_allclose(model.predict(pm, problem.x[:7]), expected.numpy(), atol=1e-5)
    network = pm[algorithm.network]
    np.testing.assert_array_equal(network[~algorithm.network_head], gm[~algorithm.network_head])
    np.testing.assert_array_equal(network[algorithm.network_head], sim.states[1].personal_head)
    np.testing.assert_array_equal(pm[algorithm.global_head], gm[algorithm.network_head])
    table = sim.host.evaluate(gm, context).to_pydict()
    scored = model.network.composed(algorithm.personalized_network())
    logits = scored.predict(pm, problem.x[problem.clients[1][1].test])
    labels = problem.y[problem.clients[1][1].test]
    assert table["pm_test_acc"][1] == pytest.approx(float(np.mean(logits.argmax(axis=1) == labels)))
    assert table["pm_test_loss"] != table["gm_test_loss"]


def test_state_is_the_same_on_one_host_or_two_and_through_a_checkpoint(tmp_path):
    """Two rounds on one host, or on two hosts owning half the clients each, or one round, a checkpoint restored
    into two hosts and one more round: the same personalized heads and server state, bit for bit."""
    problem = labelled_problem(4, 5, seed=10, held=[[0, 1], [1, 2], [0, 2], [0, 1, 2]])
    config = _config(4)
    everyone = [0, 1, 2, 3]
    one = InProcess(config, problem)
    for round_index in range(2):
        one.round(round_index, everyone)
    two = InProcess(config, problem)
    hosts = [make_host(config, problem, part) for part in (problem.clients[:2], problem.clients[2:])]
    two.round(0, everyone)
    two.host.save_checkpoint(str(tmp_path / "host-0.npz"))
    two.coordinator.save_checkpoint(str(tmp_path / "coordinator.npz"))
    for host in hosts:
        host.restore_checkpoint(str(tmp_path))
    two.coordinator.restore_checkpoint(str(tmp_path / "coordinator.npz"))
    broadcast = two.coordinator.broadcast()
    partials = [host.train(1, host.client_ids, broadcast)[0] for host in hosts]
    two.coordinator.aggregate(*partials)
    states = {c: s for host in hosts for c, s in host.client_states().items()}
    assert_identical(states, one.states)
    assert_identical(two.coordinator.state, one.coordinator.state)


def test_it_sends_the_body_global_head_and_cpn_and_keeps_the_personalized_head():
    """Uplink: CPN (2 d^2 + 6 d), body and global head (the network's size) and the weight; downlink the same
    without the weight; the personalized head (the head's size) stays."""
    problem = labelled_problem(2, 4, seed=11)
    sim = InProcess(_config(2), problem)
    algorithm = sim.coordinator.algorithm
    shared = HEADS.policy_size(FEATURES) + problem.params.size
    partial, records = sim.host.train(0, [0, 1], sim.coordinator.broadcast())
    assert records.column("uplink_bytes").to_pylist() == [4.0 * (shared + 1)] * 2
    assert sim.coordinator.broadcast_bytes() == 4 * shared
    assert sim.states[0].personal_head.size == problem.params.head_size == CLASSES * (FEATURES + 1)
    assert not algorithm.Upload.carries_message()


@pytest.mark.parametrize(("key", "value"), [("head_mix", 1.5), ("tau", 0.0), ("lambda", -1.0)])
def test_invalid_settings_are_refused_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=rf"algorithm\.{key}"):
        validate_config(tiny_config(algorithm={"name": "fedcp", key: value}))
