"""Attacks (flame.md 4.2): the forged messages, who attacks, and that exactly the attackers' messages change."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import yaml

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.evaluation.columns import RECORD_COLUMNS, evaluation_batch
from raysim.evaluation.records import ClientEvaluation, ModelScores
from raysim.evaluation.summaries import benign_summary
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.problem import prepare
from raysim.threats.attacks import AttackSettings, attack_plan, byzantine_message, malicious_clients
from raysim.training.local import ClientData
from tests.support.experiments import tiny_config
from tests.support.inprocess import make_host

ALGORITHMS = {
    "flame": {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32},
    "fedavg": {"name": "fedavg", "lr": 0.05, "batch_size": 32},
    "fedapm": {"name": "fedapm", "lr": 0.05, "batch_size": 32, "epochs": 1},
}


STATEFUL = {"flame", "fedapm"}
"""FedAvg keeps no client state, so only these can show that an attacker's state follows the protocol."""


KINDS = ["same_value", "sign_flip", "gaussian", "label_poisoning"]


def _setup(algorithm: str, attack: dict | None = None, clients: int = 6):
    config = validate_config(
        tiny_config(
            algorithm=ALGORITHMS[algorithm],
            clients={"count": clients},
            attack=attack or {"kind": "none"},
            model={"name": "mlp" if algorithm == "fedapm" else "mlr"},  # FedAPM splits off the last layer
        )
    )
    problem = prepare(config)
    host = make_host(config, problem, send_messages=True)
    coordinator = Coordinator(CoordinatorSettings(config.algorithm, problem.params, clients), problem.init_params)
    return config, problem, host, coordinator


def _round(host, coordinator, round_index: int):
    return _round_with_records(host, coordinator, round_index)[0]


def _round_with_records(host, coordinator, round_index: int):
    """Every client's message and its client-step record (train_loss, ...)."""
    partial, records = host.train(round_index, host.client_ids, coordinator.broadcast())
    coordinator.aggregate(partial)
    reported = {
        row["client_id"]: {k: v for k, v in row.items() if k not in RECORD_COLUMNS and v is not None}
        for row in records.to_pylist()
    }
    return {c: message for c, (message, _) in partial.messages.items()}, reported


@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
def test_forged_messages_follow_their_definitions(kind):
    honest = np.linspace(-1.0, 1.0, 20_000).astype(np.float32)
    settings = AttackSettings(kind=kind, fraction=0.5)
    forged = byzantine_message(settings, honest, None, np.random.default_rng(0))
    assert forged.shape == honest.shape
    if kind == "same_value":
        assert np.all(forged == forged[0])
    elif kind == "sign_flip":
        scale = forged / honest
        assert np.allclose(scale, scale[0]) and scale[0] < 0
    else:
        assert forged.std() == pytest.approx(math.sqrt(0.1), rel=0.03)
        assert abs(np.corrcoef(forged, honest)[0, 1]) < 0.05


def test_noise_presets_and_override():
    assert AttackSettings(kind="gaussian").gamma() == pytest.approx(math.sqrt(0.1))
    assert AttackSettings(kind="same_value", noise="code").gamma() == 0.01
    assert AttackSettings(kind="sign_flip", noise="code").gamma() == 1.0
    assert AttackSettings(kind="gaussian", noise="code", std=3.0).gamma() == 3.0
    settings = AttackSettings(kind="same_value")
    draws = [byzantine_message(settings, np.zeros(1), None, np.random.default_rng(s))[0] for s in range(4000)]
    assert np.std(draws) == pytest.approx(math.sqrt(0.1), rel=0.05)


def test_sign_flip_on_the_global_model_is_the_codes_variant():
    settings = AttackSettings(kind="sign_flip", sign_flip_base="global")
    w = np.arange(1.0, 6.0, dtype=np.float32)
    forged = byzantine_message(settings, np.ones(5, np.float32), w, np.random.default_rng(1))
    assert np.allclose(forged / w, forged[0] / w[0]) and forged[0] < 0
    with pytest.raises(ValueError, match="sign_flip_base=global"):
        byzantine_message(settings, np.ones(5, np.float32), {"not": "a vector"}, np.random.default_rng(1))


@pytest.mark.parametrize(("fraction", "count"), [(0.0, 0), (0.2, 10), (0.5, 25), (0.8, 40), (0.99, 49)])
def test_malicious_set_size_and_determinism(fraction, count):
    settings = AttackSettings(kind="gaussian", fraction=fraction)
    chosen = malicious_clients(settings, 50, seed=3)
    assert len(chosen) == count and chosen <= set(range(50))
    assert chosen == malicious_clients(settings, 50, seed=3)
    assert malicious_clients(AttackSettings(kind="none", fraction=0.5), 50, 3) == frozenset()


@pytest.mark.parametrize("algorithm", ["flame", "fedavg", "fedapm"])
@pytest.mark.parametrize("kind", ["same_value", "sign_flip", "gaussian"])
def test_byzantine_attacks_change_exactly_the_attackers_messages(algorithm, kind):
    """The message is what the paper says the client uploads: FLAME u_i, FedAvg the local model, FedAPM z_i of
    the shared part only (its personal part v_i never leaves the client)."""
    _, _, honest_host, honest_coordinator = _setup(algorithm)
    _, problem, host, coordinator = _setup(algorithm, {"kind": kind, "fraction": 0.5})
    attackers = problem.malicious
    assert len(attackers) == 3
    honest, honest_records = _round_with_records(honest_host, honest_coordinator, 0)
    attacked, records = _round_with_records(host, coordinator, 0)
    shared = len(honest_coordinator.global_model()) if algorithm != "fedapm" else len(honest_coordinator.state.u)
    assert all(len(m) == shared for m in attacked.values())
    if algorithm == "fedapm":  # the shared part only
        assert shared < len(problem.init_params)
    for client_id in range(6):
        if client_id in attackers:
            expected = problem.attack.corrupt(client_id, 0, honest[client_id], honest_coordinator.broadcast())
            assert not np.allclose(attacked[client_id], honest[client_id])
            np.testing.assert_allclose(attacked[client_id], expected, rtol=1e-6)  # honest[...] was rounded to f32
        else:
            np.testing.assert_array_equal(attacked[client_id], honest[client_id])
    # attackers run the honest step (training: train): the same local training loss as without the attack ...
    for client_id in range(6):
        assert records[client_id]["train_loss"] == honest_records[client_id]["train_loss"]
    # ... and their own state follows the honest protocol; only what they send is forged
    states, honest_states = host.client_states(), honest_host.client_states()
    if algorithm not in STATEFUL:
        assert all(vars(state) == {} for state in states.values())  # nothing kept, nothing to compare
        return
    for client_id in attackers:
        fields = vars(honest_states[client_id])
        assert fields
        for name, value in fields.items():
            np.testing.assert_array_equal(value, getattr(states[client_id], name))


def test_flame_server_sums_the_latest_forged_messages_over_rounds():
    """FLAME uploads u_i^new - u_i^old; an attacker's delta must be taken from its previous FORGED u_i, so the
    server's running sum stays the sum of the messages the clients sent last (eq. 14)."""
    _, problem, host, coordinator = _setup("flame", {"kind": "gaussian", "fraction": 0.5})
    latest = {}
    for round_index in range(3):
        selected = [0, 1, 2, 3, 4, 5] if round_index != 1 else [0, 3, 5]
        partial, _ = host.train(round_index, selected, coordinator.broadcast())
        coordinator.aggregate(partial)
        latest |= {c: m for c, (m, _) in partial.messages.items()}
        expected = np.sum([latest[c].astype(np.float64) for c in range(6)], axis=0)
        np.testing.assert_allclose(coordinator.server_state().running_sum, expected, atol=1e-5)
        np.testing.assert_allclose(coordinator.global_model(), expected / 6, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["flame", "fedavg", "fedapm"])
@pytest.mark.parametrize("kind", KINDS)
def test_fraction_zero_changes_nothing(algorithm, kind):
    _, _, plain_host, plain_coordinator = _setup(algorithm)
    _, problem, host, coordinator = _setup(algorithm, {"kind": kind, "fraction": 0.0})
    assert problem.malicious == frozenset()
    for round_index in range(2):
        plain = _round(plain_host, plain_coordinator, round_index)
        attacked = _round(host, coordinator, round_index)
        for client_id in range(6):
            np.testing.assert_array_equal(attacked[client_id], plain[client_id])
    np.testing.assert_array_equal(plain_coordinator.global_model(), coordinator.global_model())
    for client_id, state in plain_host.client_states().items():
        for name, value in vars(state).items():
            np.testing.assert_array_equal(value, getattr(host.client_states()[client_id], name))


def test_label_poisoning_redraws_labels_at_every_access_and_leaves_features():
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.zeros(20, dtype=np.int64)
    data = ClientData(x, y, np.arange(20), np.arange(0), np.arange(0), random_labels=10)
    generator = np.random.default_rng(0)
    first, second = data.arrays("train", generator), data.arrays("train", generator)
    np.testing.assert_array_equal(first[0], x)
    assert set(first[1]) <= set(range(10)) and not np.array_equal(first[1], second[1])
    with pytest.raises(ValueError, match="needs a generator"):
        data.arrays("train")
    clean = ClientData(x, y, np.arange(20), np.arange(0), np.arange(0))
    np.testing.assert_array_equal(clean.arrays("train")[1], y)


def test_quality_noise_is_gaussian_with_the_clients_std_and_fresh_per_access():
    x = np.zeros((5000, 4), dtype=np.float32)
    data = ClientData(x, np.zeros(5000, np.int64), np.arange(5000), np.arange(0), np.arange(0), noise_std=0.3)
    generator = np.random.default_rng(0)
    first, second = data.arrays("train", generator)[0], data.arrays("train", generator)[0]
    assert first.std() == pytest.approx(0.3, rel=0.03) and not np.array_equal(first, second)


@pytest.mark.parametrize("algorithm", ["fedavg", "flame"])
def test_label_poisoning_changes_only_the_attackers_updates(algorithm):
    """Poisoners train on random labels and then follow the protocol: their messages (and, for FLAME, their
    state) differ from the clean run's, every benign client's are bit for bit the same."""
    _, _, plain_host, plain_coordinator = _setup(algorithm)
    _, problem, host, coordinator = _setup(algorithm, {"kind": "label_poisoning", "fraction": 0.5})
    assert len(problem.malicious) == 3
    plain, poisoned = _round(plain_host, plain_coordinator, 0), _round(host, coordinator, 0)
    for client_id in range(6):
        same = np.array_equal(plain[client_id], poisoned[client_id])
        assert same == (client_id not in problem.malicious)
    if algorithm == "flame":  # the messages follow the protocol from a poisoned theta-step: u_i = w_i + pi_i/rho
        rho = ALGORITHMS["flame"]["rho"]
        for client_id, state in host.client_states().items():
            np.testing.assert_allclose(poisoned[client_id], state.w + state.pi / rho, rtol=1e-5, atol=1e-6)


def test_metrics_exclude_attackers():
    def scores(acc, loss):
        return ModelScores(acc, loss, loss)

    evaluations = [ClientEvaluation(c, scores(0.9, 0.2), scores(0.8, 0.3)) for c in range(3)]
    evaluations.append(ClientEvaluation(3, scores(0.0, 9.0), scores(0.0, 9.0)))
    summary = benign_summary(evaluation_batch(evaluations), frozenset({3}))
    assert summary["pm/acc"] == pytest.approx(0.9) and summary["gm/loss"] == pytest.approx(0.3)
    assert summary["pm/loss_var"] == pytest.approx(0.0, abs=1e-12) and summary["hm/acc_min"] == pytest.approx(0.9)
    assert summary["pm/lagging_share"] == 0.0 and summary["gm/acc_std"] == pytest.approx(0.0, abs=1e-12)
    assert benign_summary(evaluation_batch(evaluations), frozenset())["pm/acc"] == pytest.approx(0.675)


def test_attack_plan_is_part_of_prepare_and_config_checks_the_message():
    config = validate_config(tiny_config(clients={"count": 10}, attack={"kind": "gaussian", "fraction": 0.2}))
    assert prepare(config).malicious == attack_plan(config.attack, 10, config.seed).malicious
    with pytest.raises(ConfigError, match="attack.fraction"):
        validate_config(tiny_config(attack={"kind": "gaussian", "fraction": 1.5}))


def test_lagging_share_counts_clients_more_than_ten_points_below_the_mean():
    accuracies = [0.9, 0.9, 0.9, 0.5]  # mean 0.8: only the last is below 0.7
    evaluations = [
        ClientEvaluation(c, ModelScores(a, 1.0, 1.0), ModelScores(a, 1.0, 1.0)) for c, a in enumerate(accuracies)
    ]
    summary = benign_summary(evaluation_batch(evaluations), frozenset())
    assert summary["pm/lagging_share"] == 0.25
    assert summary["pm/acc_std"] == pytest.approx(np.std(accuracies, ddof=1))
    assert benign_summary(evaluation_batch(evaluations), frozenset({3}))["pm/lagging_share"] == 0.0


def test_label_poisoning_needs_class_labels():
    config = validate_config(
        tiny_config(
            dataset={"name": "synthetic_regression"},
            partition={"scheme": "iid"},
            model={"name": "linear"},
            attack={"kind": "label_poisoning", "fraction": 0.5},
        )
    )
    with pytest.raises(ConfigError, match="attack.kind=label_poisoning"):
        prepare(config)


def test_fixed_label_poisoning_draws_the_labels_once():
    _, problem, host, _ = _setup("fedavg", {"kind": "label_poisoning", "fraction": 0.5, "labels": "fixed"})
    attacker = min(problem.malicious)
    benign = min(set(range(6)) - problem.malicious)
    data = host.data[attacker]
    first = data.arrays("train", np.random.default_rng(0))[1]
    second = data.arrays("train", np.random.default_rng(1))[1]
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, problem.y[data.train])
    np.testing.assert_array_equal(host.data[benign].arrays("train")[1], problem.y[host.data[benign].train])


@pytest.mark.parametrize(
    ("fraction", "m", "paper", "code"),
    [(0.0, 10, 0, 1), (0.05, 10, 0, 1), (0.2, 50, 10, 10), (0.29, 100, 29, 29), (0.5, 7, 3, 3), (0.8, 7, 5, 5)],
)
def test_attacker_count_is_floor_f_m_and_at_least_one_with_the_codes_rule(fraction, m, paper, code):
    """flame.md 4.2: int(f m) (paper; exact floor, where Python's int(0.29 * 100) would give 28) and the
    authors' max(int(f m), 1), which attacks even at fraction 0."""
    for rule, expected in (("paper", paper), ("code", code)):
        settings = AttackSettings(kind="same_value", fraction=fraction, count=rule)
        assert settings.num_malicious(m) == expected == len(malicious_clients(settings, m, seed=2))
        if fraction == 0:
            assert settings.active == (rule == "code")  # the robustness plot then shows it as attacked
    assert AttackSettings(kind="none", fraction=0.5, count="code").num_malicious(10) == 0


def test_skipping_attackers_keep_their_state_and_upload_only_the_forged_message():
    """attack.training = skip (authors' code): no local work, the client's state stays as it was, its message is
    the attack vector, and FLAME's running sum is still the sum of the latest messages sent (eq. 14)."""
    _, problem, host, coordinator = _setup("flame", {"kind": "gaussian", "fraction": 0.5, "training": "skip"})
    initial = host.client_states()
    latest = {}
    for round_index in range(3):
        selected = [0, 1, 2, 3, 4, 5] if round_index != 1 else [0, 3, 5]
        broadcast = coordinator.broadcast()
        partial, records = host.train(round_index, selected, broadcast)
        coordinator.aggregate(partial)
        latest |= {c: m for c, (m, _) in partial.messages.items()}
        for client_id, loss in zip(records["client_id"].to_pylist(), records["train_loss"].to_pylist(), strict=True):
            assert (loss is not None) == (client_id not in problem.malicious)
        for client_id in problem.malicious & set(selected):
            forged = problem.attack.corrupt(client_id, round_index, latest[client_id], broadcast)
            np.testing.assert_array_equal(latest[client_id], forged)
        expected = np.sum([latest.get(c, problem.init_params).astype(np.float64) for c in range(6)], axis=0)
        np.testing.assert_allclose(coordinator.server_state().running_sum, expected, atol=1e-5)
    states = host.client_states()
    for client_id in range(6):
        kept = vars(initial[client_id]).items()
        same = all(np.array_equal(v, getattr(states[client_id], k), equal_nan=True) for k, v in kept)
        assert same == (client_id in problem.malicious)


def test_skipping_sign_flip_scales_the_untrained_message_the_received_global_model():
    """FedAvg with training = skip: the 'honest' message is the local model after no training, i.e. w^t, so
    -|p| u_i becomes the code's -|p| w^t."""
    _, problem, host, coordinator = _setup("fedavg", {"kind": "sign_flip", "fraction": 0.5, "training": "skip"})
    _round(host, coordinator, 0)
    w = coordinator.global_model()
    messages = _round(host, coordinator, 1)
    for client_id in problem.malicious:
        ratio = messages[client_id] / w
        assert ratio[0] < 0 and np.allclose(ratio, ratio[0], rtol=1e-5)


@pytest.mark.parametrize(
    ("attack", "clients", "shown"),
    [
        ({"kind": "gaussian", "fraction": 1.0}, 6, "attack.fraction=1.0 (attack.count=paper) makes all 6 clients"),
        ({"kind": "label_poisoning", "fraction": 1.0}, 4, "attack.fraction=1.0 (attack.count=paper) makes all 4"),
        (
            {"kind": "same_value", "fraction": 0.0, "count": "code"},
            1,
            "attack.fraction=0.0 (attack.count=code) makes all 1 clients",
        ),
    ],
)
def test_an_attack_without_benign_clients_is_refused_before_any_ray_work(attack, clients, shown, tmp_path, capsys):
    """Every metric is over benign clients, so a run with none used to crash at its round-0 evaluation after
    Ray had started; it is now one config error from prepare(), before MLflow or Ray are touched."""
    import ray

    from raysim.cli import main
    from raysim.runtime.driver import run_experiment

    store = tmp_path / "mlflow.db"
    data = tiny_config(attack=attack, clients={"count": clients}, tracking={"uri": f"sqlite:///{store}"})
    config = validate_config(data)
    with pytest.raises(ConfigError, match=re.escape(shown)) as error:
        prepare(config)
    assert "no benign client would be left to score" in str(error.value) and "\n" not in str(error.value)
    ray_was_up = ray.is_initialized()
    with pytest.raises(ConfigError, match="no benign client"):
        run_experiment(config, show_progress=False)
    assert not store.exists() and ray.is_initialized() == ray_was_up  # no MLflow run, no Ray started
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {shown}")
    assert not store.exists()
