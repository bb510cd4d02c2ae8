"""FedGen (raysim.algorithms.fedgen): without the regularizer it is FedAvg; a client step's requests and upload; the
local term is CE plus eq. 6's loss on generated features, whose gradient reaches the head alone; the server's
generator steps lower the label-weighted ensemble loss (eq. 4-5) and are deterministic; the label-count weights
alpha_{k,y}; the Adam steps carry over rounds as torch's; the communication accounting; the authors' defaults."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedgen import (
    FedGenServerState,
    FedGenSettings,
    FedGenUpload,
    GeneratedFeaturesLoss,
    Generator,
    diversity_loss,
    ensemble_loss,
    label_weights,
    split_head,
)
from raysim.algorithms.requests import ClassMeans, LocalSGD
from raysim.models.flat import FlatModel
from raysim.models.spec import ParamSpec
from raysim.runtime.checkpoint import load_tree, save_tree
from tests.support.split_models import simulate, step_results

CLASSES, D = 3, 4
SPEC = ParamSpec(
    names=("body", "head.weight", "head.bias"),
    shapes=((5,), (CLASSES, D), (CLASSES,)),
    offsets=(0, 5, 5 + CLASSES * D),
    head=("head.weight", "head.bias"),
)  # a body of 5, a head on d = 4 features and 3 classes
HEAD = CLASSES * D + CLASSES
SMALL = {"noise_dim": 3, "hidden_dim": 8, "generator_batch_size": 16}


def _fedgen(**settings):
    return build_algorithm(FedGenSettings(name="fedgen", **{**SMALL, **settings}), SPEC)


def _heads(seed: int = 0, clients: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(clients, HEAD)).astype(np.float32)


def _messages(heads: np.ndarray, counts: np.ndarray, ids: list[int]) -> dict[int, np.ndarray]:
    return {c: np.concatenate([heads[i], counts[i]]) for i, c in enumerate(ids)}


def _total(size: int = SPEC.size, n: float = 10.0) -> FedGenUpload:
    return FedGenUpload(np.full(size, n), n, np.zeros(CLASSES), np.zeros(HEAD))


def _fixed_loss(algorithm, state: FedGenServerState, heads, counts, seed: int = 99) -> float:
    """The ensemble loss of the state's generator on one fixed batch (every label, batch statistics)."""
    layout = algorithm.layout
    rng = np.random.default_rng(seed)
    labels, noise = layout.draw(rng, np.ones(CLASSES), 240, algorithm.settings.noise)
    y = torch.from_numpy(labels)
    with torch.no_grad():
        z = layout.forward(torch.tensor(state.generator), torch.tensor(state.statistics), y, torch.tensor(noise), True)
        weights, biases = split_head(SPEC, torch.tensor(heads))
        alpha = torch.tensor(label_weights(counts), dtype=torch.float32)
        return ensemble_loss(z, y, weights, biases, alpha, algorithm.settings.ensemble).item()


def test_without_the_regularizer_it_is_fedavg():
    """alpha = beta = 0: the clients train on plain CE and the models are averaged by n_i, round after round, while
    the generator still learns on the server."""
    fedgen = simulate({"name": "fedgen", "alpha": 0.0, "beta": 0.0, "epochs": 2}, rounds=3)
    fedavg = simulate({"name": "fedavg", "aggregation": "samples", "epochs": 2}, rounds=3)
    global_model = fedgen.coordinator.global_model()
    np.testing.assert_allclose(global_model, fedavg.coordinator.global_model(), atol=1e-5)
    assert np.linalg.norm(global_model - fedgen.problem.init_params) > 1e-2
    assert fedgen.server.steps == 3 * 50 and fedgen.server.rounds == 3
    broadcast = fedgen.coordinator.broadcast()
    assert broadcast.labels.any() and fedgen.host.algorithm.regularizer(broadcast) is None


def test_a_client_step_counts_its_labels_then_trains_on_ce_plus_the_generated_features_loss():
    """Round 0: no generator yet, plain CE. Then the counts (a request that draws nothing), and local SGD from the
    global model with the term: alpha_t = 10 * 0.98^t * B'/B, y^ from the latest counts of every client."""
    sim = simulate({"name": "fedgen", "epochs": 1, "beta": 2.0}, rounds=0)
    broadcast = sim.coordinator.broadcast()
    update, requests, _ = step_results(sim, 1, broadcast)
    assert isinstance(requests[0], ClassMeans) and requests[0].point is None
    assert requests[1].terms == () and not broadcast.labels.any()
    for round_index in range(2):
        sim.round(round_index)
    broadcast = sim.coordinator.broadcast()
    update, requests, results = step_results(sim, 1, broadcast)
    counts, sgd = requests
    assert isinstance(counts, ClassMeans) and isinstance(sgd, LocalSGD)
    np.testing.assert_array_equal(sgd.start, sim.coordinator.global_model())
    (term,) = sgd.terms
    assert isinstance(term, GeneratedFeaturesLoss)
    assert term.alpha == pytest.approx(10 * 0.98**2 * 32 / 32) and term.beta == pytest.approx(2 * 0.98**2)
    assert term.synthetic == 32 and term.noise == "uniform"
    seen = sim.server.label_counts.sum(axis=0)
    np.testing.assert_allclose(term.labels, seen / seen.sum())
    np.testing.assert_array_equal(term.generator, sim.server.generator)
    np.testing.assert_array_equal(term.statistics, sim.server.statistics)
    info = sim.host.info[1]
    train = sim.problem.clients[1][1].train
    expected = np.bincount(sim.problem.y[train], minlength=term.layout.classes)
    np.testing.assert_array_equal(update.upload.counts, expected)
    assert update.upload.weight == info.num_train == expected.sum()
    theta = results[1].params
    np.testing.assert_allclose(update.upload.weighted, info.num_train * theta.astype(np.float64))
    algorithm = sim.host.algorithm
    np.testing.assert_array_equal(algorithm.message(update), np.concatenate([theta[algorithm.head], expected]))


def test_the_term_is_cross_entropy_plus_the_loss_on_generated_features_and_g_is_constant():
    """The term on a batch: CE(h(f(x)), y) + alpha CE(h(G(y^, eps)), y^) + beta KL(softmax(h(G(y, eps'))) ||
    softmax(h(f(x)))) with the step's draws and G on its running statistics; the alpha part's gradient is zero
    on the body (G's features are constants) and on it alone the head moves."""
    source = np.random.default_rng(3)
    model = FlatModel("mlp", (6,), CLASSES)
    layout = Generator(3, CLASSES, 8, model.spec.feature_dim, True)
    phi, _ = layout.initial(source)
    statistics = np.concatenate([source.normal(size=8), source.uniform(0.5, 2.0, size=8)]).astype(np.float32)
    point = torch.from_numpy(model.initial_parameters(1))
    x = torch.from_numpy(source.normal(size=(12, 6)).astype(np.float32))
    y = torch.from_numpy(np.tile(np.arange(CLASSES), 4))
    labels = np.array([0.2, 0.0, 0.8])
    term = GeneratedFeaturesLoss(phi, statistics, layout, labels, 0.7, 0.3, 10, "uniform")
    value, grad = term.loss_and_grad(model, point, x, y, 1234)
    sampled, noise, latent = term.draw(1234, 12)
    assert not (sampled == 1).any() and noise.shape == (10, 3) and latent.shape == (12, 3)
    assert noise.min() >= 0 and noise.max() < 1
    head = model.spec.head_mask()
    weight, bias = split_head(model.spec, point[torch.from_numpy(head)])

    def generated(labels_, eps):  # BatchNorm by hand, on the running statistics
        w1, b1, gamma, beta, w2, b2 = layout.split(torch.from_numpy(phi))
        inputs = torch.cat([torch.from_numpy(eps), torch.nn.functional.one_hot(torch.as_tensor(labels_), CLASSES)], 1)
        hidden = inputs @ w1.T + b1
        mean, variance = torch.from_numpy(statistics[:8]), torch.from_numpy(statistics[8:])
        hidden = (hidden - mean) / torch.sqrt(variance + 1e-5) * gamma + beta
        return torch.relu(hidden) @ w2.T + b2

    with torch.no_grad():
        _, logits = model.features(point, x)
        ce = torch.nn.functional.cross_entropy(logits, y).item()
        fake = torch.nn.functional.cross_entropy(generated(sampled, noise) @ weight.T + bias, torch.from_numpy(sampled))
        target = torch.softmax(generated(y.numpy(), latent) @ weight.T + bias, dim=1)
        kl = (target * (target.log() - torch.log_softmax(logits, dim=1))).sum(dim=1).mean()
    assert value == pytest.approx(ce + 0.7 * fake.item() + 0.3 * kl.item(), rel=1e-5)
    plain_loss, plain_grad = model.loss_and_grad(point, x, y)
    alpha_only = GeneratedFeaturesLoss(phi, statistics, layout, labels, 0.7, 0.0, 10, "uniform")
    value, grad = alpha_only.loss_and_grad(model, point, x, y, 1234)
    extra = (grad - plain_grad).numpy()
    assert not extra[~head].any() and np.abs(extra[head]).max() > 1e-3
    assert value == pytest.approx(plain_loss + 0.7 * fake.item(), rel=1e-5)


def test_the_generator_steps_lower_the_label_weighted_ensemble_loss_deterministically():
    """A hand-made round: two heads, client 0 holding labels 0 and 1, client 1 labels 1 and 2. The generator's
    steps lower eq. 5's loss on a fixed batch, move its running statistics and Adam state, and the same state gives
    the same bits."""
    algorithm = _fedgen(generator_lr=1e-2, generator_steps=60, diversity=0.0)
    server = algorithm.init_server(np.zeros(SPEC.size, np.float32), 4)
    heads = _heads()
    counts = np.array([[30.0, 10.0, 0.0], [0.0, 10.0, 20.0]])
    messages = _messages(heads, counts, [3, 1])
    after, metrics = algorithm.server_step_by_client(server, _total(), 2, messages)
    before_loss, after_loss = (_fixed_loss(algorithm, s, heads, counts) for s in (server, after))
    assert after_loss < 0.5 * before_loss
    assert metrics["generator_loss"] > after_loss
    again, _ = algorithm.server_step_by_client(server, _total(), 2, messages)
    for name in ("generator", "statistics", "first", "second"):
        np.testing.assert_array_equal(getattr(again, name), getattr(after, name))
    assert not np.array_equal(after.statistics, server.statistics)
    assert (after.steps, after.rounds, server.steps, server.rounds) == (60, 1, 0, 0)
    np.testing.assert_array_equal(after.label_counts[[3, 1]], counts)
    assert not after.label_counts[[0, 2]].any()
    np.testing.assert_array_equal(after.model, np.ones(SPEC.size, np.float32))  # sum n_i theta_i / sum n_i


def test_alpha_is_each_clients_share_of_the_label():
    """alpha_{k,y} = c_{k,y} / sum_j c_{j,y}; the ensemble loss is sum_k alpha_{k,y} CE(h_k(z), y) per sample (or
    the CE of the alpha-weighted logits), so a head weighs nothing on labels its client does not hold."""
    counts = np.array([[30.0, 10.0, 0.0, 0.0], [0.0, 30.0, 20.0, 0.0]])
    alpha = label_weights(counts)
    np.testing.assert_allclose(alpha, [[1.0, 0.25, 0.0, 0.0], [0.0, 0.75, 1.0, 0.0]])
    source = np.random.default_rng(5)
    heads = source.normal(size=(2, HEAD)).astype(np.float32)
    z = torch.tensor(source.normal(size=(9, D)), dtype=torch.float32)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    weights, biases = split_head(SPEC, torch.tensor(heads))
    shares = torch.tensor(alpha[:, :CLASSES], dtype=torch.float32)
    logits = [z @ weights[k].T + biases[k] for k in range(2)]
    per_client = [torch.nn.functional.cross_entropy(each, y, reduction="none") for each in logits]
    expected = sum(shares[k, y] * per_client[k] for k in range(2)).mean()
    torch.testing.assert_close(ensemble_loss(z, y, weights, biases, shares, "losses"), expected)
    mixed = sum(shares[k, y][:, None] * logits[k] for k in range(2))
    expected = torch.nn.functional.cross_entropy(mixed, y)
    torch.testing.assert_close(ensemble_loss(z, y, weights, biases, shares, "logits"), expected)
    other = heads.copy()
    other[1] = source.normal(size=HEAD)  # client 1 holds no label 0
    label0 = y == 0
    for ensemble in ("losses", "logits"):
        kept = ensemble_loss(z[label0], y[label0], weights, biases, shares, ensemble)
        changed = ensemble_loss(z[label0], y[label0], *split_head(SPEC, torch.tensor(other)), shares, ensemble)
        torch.testing.assert_close(kept, changed)
        assert ensemble_loss(z, y, *split_head(SPEC, torch.tensor(other)), shares, ensemble) != ensemble_loss(
            z, y, weights, biases, shares, ensemble
        )


def test_server_labels_follow_the_counts_or_are_uniform_over_the_held_ones():
    prior, uniform = _fedgen(), _fedgen(label_sampling="uniform")
    counts = np.array([0.0, 3.0, 1.0])
    np.testing.assert_array_equal(prior.sampling(counts), counts)
    np.testing.assert_array_equal(uniform.sampling(counts), [0.0, 1.0, 1.0])
    server = uniform.init_server(np.zeros(SPEC.size, np.float32), 3)
    assert not uniform.broadcast(server).labels.any()  # before any generator step: no regularizer
    after, _ = uniform.server_step_by_client(server, _total(), 1, _messages(_heads(1, 1), counts[None], [2]))
    np.testing.assert_allclose(uniform.broadcast(after).labels, [0.0, 0.5, 0.5])
    after, _ = prior.server_step_by_client(server, _total(), 1, _messages(_heads(1, 1), counts[None], [2]))
    np.testing.assert_allclose(prior.broadcast(after).labels, [0.0, 0.75, 0.25])


def test_the_adam_steps_carry_over_rounds_as_torchs():
    """Two rounds of 3 steps against one torch.optim.Adam over 6 steps (weight decay, the rate decayed per round,
    the same draws), with the diversity loss."""
    algorithm = _fedgen(generator_lr=0.05, generator_lr_decay=0.5, generator_steps=3, generator_weight_decay=0.1)
    server = algorithm.init_server(np.zeros(SPEC.size, np.float32), 2)
    layout, s = algorithm.layout, algorithm.settings
    phi = torch.tensor(server.generator, requires_grad=True)
    statistics = torch.tensor(server.statistics)
    reference = torch.optim.Adam([phi], lr=0.05, weight_decay=0.1)
    counts = np.array([[4.0, 0.0, 2.0], [1.0, 5.0, 0.0]])
    heads = _heads(2)
    weights, biases = split_head(SPEC, torch.tensor(heads))
    alpha = torch.tensor(label_weights(counts), dtype=torch.float32)
    for round_index in range(2):
        server, _ = algorithm.server_step_by_client(server, _total(), 2, _messages(heads, counts, [0, 1]))
        rng = np.random.default_rng([server.seed, round_index])
        reference.param_groups[0]["lr"] = 0.05 * 0.5**round_index
        for _ in range(3):
            drawn, eps = layout.draw(rng, counts.sum(axis=0), s.generator_batch_size, s.noise)
            y, noise = torch.from_numpy(drawn), torch.from_numpy(eps)
            z = layout.forward(phi, statistics, y, noise, training=True)
            loss = ensemble_loss(z, y, weights, biases, alpha, "losses") + diversity_loss(noise, z)
            reference.zero_grad()
            loss.backward()
            reference.step()
        np.testing.assert_allclose(server.generator, phi.detach().numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(server.statistics, statistics.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(server.second, reference.state[phi]["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-12)
    assert server.steps == 6


def test_the_diversity_loss_is_the_authors():
    """exp(-mean_{i,j} mean_l (eps_il - eps_jl)^2 * mean_l |z_il - z_jl|)."""
    source = np.random.default_rng(6)
    eps, z = source.random((5, 3)), source.normal(size=(5, 4))
    d_eps = ((eps[:, None] - eps[None]) ** 2).mean(axis=2)
    d_z = np.abs(z[:, None] - z[None]).mean(axis=2)
    value = diversity_loss(torch.tensor(eps), torch.tensor(z)).item()
    assert value == pytest.approx(np.exp(-(d_eps * d_z).mean()), rel=1e-12)


def test_communication_counts_the_model_the_generator_and_the_labels():
    """Down: the model, G's parameters and running statistics, and p^(y); up: the model, n_i and c_k."""
    sim = simulate({"name": "fedgen"}, rounds=1)
    algorithm = sim.host.algorithm
    n, classes, d = algorithm.params.size, algorithm.params.head_outputs, algorithm.params.feature_dim
    generator = (32 + classes) * 256 + 256 + 2 * 256 + 256 * d + d
    assert algorithm.layout.size == generator and algorithm.layout.statistics_size == 2 * 256
    broadcast = sim.coordinator.broadcast()
    assert algorithm.downlink_bytes(broadcast) == 4 * (n + generator + 2 * 256 + classes)
    upload = FedGenUpload(np.zeros(n), 1.0, np.zeros(classes), np.zeros(int(algorithm.head.sum())))
    assert algorithm.uplink_bytes(upload) == 4 * (n + 1 + classes)
    assert not algorithm.Upload.carries_message() and algorithm.reads_messages(algorithm.settings)
    plain = build_algorithm(FedGenSettings(name="fedgen", batch_norm=False), algorithm.params)
    assert plain.layout.size == generator - 2 * 256 and plain.layout.statistics_size == 0


def test_the_authors_defaults_and_a_checkpointed_state(tmp_path):
    s = FedGenSettings(name="fedgen")
    assert (s.alpha, s.beta, s.coefficient_decay, s.synthetic_batch_size) == (10.0, 0.0, 0.98, 32)
    assert (s.noise_dim, s.hidden_dim, s.batch_norm, s.noise) == (32, 256, True, "uniform")
    assert (s.generator_lr, s.generator_lr_decay, s.generator_weight_decay) == (3e-4, 0.98, 1e-2)
    assert (s.generator_steps, s.generator_batch_size, s.diversity) == (50, 32, 1.0)
    assert (s.ensemble, s.label_sampling) == ("losses", "prior")
    algorithm = build_algorithm(s, SPEC)
    assert algorithm.coefficient(10.0, 1000) == 1e-4 and algorithm.coefficient(0.0, 3) == 0.0
    sim = simulate({"name": "fedgen", "generator_steps": 2}, rounds=2)
    save_tree(tmp_path / "server.npz", sim.server)
    restored = load_tree(tmp_path / "server.npz")
    assert (restored.steps, restored.rounds, restored.seed) == (4, 2, sim.server.seed)
    for name in ("model", "generator", "statistics", "first", "second", "label_counts"):
        np.testing.assert_array_equal(getattr(restored, name), getattr(sim.server, name))
