"""Robust aggregation: the rules themselves, and how they combine with averaging and running-sum servers."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.problem import prepare
from raysim.threats.robust import RobustSettings, aggregate, multi_krum, norm_clip, trimmed_mean
from tests.support.experiments import tiny_config
from tests.support.inprocess import make_host


def _cluster_with_outlier(n: int = 10, d: int = 30, seed: int = 0) -> np.ndarray:
    generator = np.random.default_rng(seed)
    messages = generator.normal(0.0, 0.1, size=(n, d))
    messages[3] = 50.0
    return messages


@pytest.mark.parametrize("variant", ["blanchard", "code"])
def test_multi_krum_rejects_a_planted_outlier(variant):
    messages = _cluster_with_outlier()
    aggregate_, chosen = multi_krum(messages, byzantine=1, selected=9, variant=variant)
    assert 3 not in chosen and len(chosen) == 9
    np.testing.assert_allclose(aggregate_, np.delete(messages, 3, axis=0).mean(axis=0))
    _, default = multi_krum(messages, byzantine=1, variant=variant)
    assert len(default) == {"blanchard": 9, "code": 5}[variant] and 3 not in default  # n - f, or the helper's 5


def authors_helper(messages: np.ndarray, fraction: float) -> tuple[np.ndarray, set[int]]:
    """The FLAME authors' Multi-Krum helper (zsk66/FLAME src/utils.py average_weights, aggr 'mkrum'; flame.md 2.6),
    replayed step by step in torch: f = int(n * fraction); a symmetric matrix of float32 L2 distances filled pair by
    pair; score_i = the sum of the first n - f - 1 entries of row i sorted, its zero self-distance among them; the
    mean of the 5 rows torch.topk(scores, 5, largest=False) picks."""
    import torch

    rows = [torch.tensor(m, dtype=torch.float32) for m in messages]
    n = len(rows)
    f = int(n * fraction)
    dists = torch.zeros(n, n)
    for i in range(n):
        for j in range(i, n):
            dists[i][j] = torch.norm(rows[i] - rows[j], p=2)
            dists[j][i] = dists[i][j]
    scores = torch.zeros(n)
    for i in range(n):
        d, _ = dists[i].sort()
        scores[i] = d[: n - f - 1].sum()
    picked = torch.topk(scores, 5, largest=False).indices.tolist()
    return torch.stack([rows[i] for i in picked]).mean(dim=0).numpy(), set(picked)


HAND_MADE = np.array([[4, -3], [2, -6], [3, 2], [-6, -1], [5, 5], [-2, 5], [5, 0], [-5, -2]], dtype=np.float64)
"""Eight 2-D messages, f = 1, whose ranking by plain distances (the helper) and by squared ones (Blanchard) differ."""


def test_the_code_variant_is_the_authors_helper_where_blanchards_chooses_otherwise():
    expected, picked = authors_helper(HAND_MADE, fraction=1 / 8)
    aggregate_, chosen = multi_krum(HAND_MADE, byzantine=1, variant="code")
    assert set(chosen.tolist()) == picked == {0, 2, 4, 6, 7}
    np.testing.assert_allclose(aggregate_, expected, rtol=1e-6)
    _, blanchard = multi_krum(HAND_MADE, byzantine=1, selected=5)  # same count: the scores alone differ
    assert set(blanchard.tolist()) == {0, 1, 2, 5, 6} != picked
    assert len(multi_krum(HAND_MADE, byzantine=1)[1]) == 7  # Blanchard's default n - f
    settings = RobustSettings(rule="multi_krum", krum_variant="code")
    np.testing.assert_allclose(aggregate(settings, HAND_MADE, 1, np.zeros(2)), expected, rtol=1e-6)


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.8])
def test_the_code_variant_replays_the_helper_on_a_robustness_round(fraction):
    """50 messages as in FLAME's robustness runs: benign models around one point, the attackers' Gaussian vectors
    (std 1, the code's GA) and same-value vectors; the helper's f = int(50 * fraction)."""
    generator = np.random.default_rng(7)
    messages = generator.normal(0.3, 0.05, size=(50, 400))
    attackers = generator.choice(50, int(50 * fraction), replace=False)
    for k, client in enumerate(attackers):
        messages[client] = generator.normal(size=400) if k % 2 else np.full(400, generator.normal(0.0, 0.01))
    expected, picked = authors_helper(messages, fraction)
    aggregate_, chosen = multi_krum(messages, byzantine=int(50 * fraction), variant="code")
    assert set(chosen.tolist()) == picked and len(picked) == 5
    np.testing.assert_allclose(aggregate_, expected, rtol=1e-5, atol=1e-6)


def test_median_and_trimmed_mean_ignore_a_planted_outlier():
    messages = _cluster_with_outlier()
    assert np.abs(aggregate(RobustSettings(rule="median"), messages, 1, np.zeros(30))).max() < 0.2
    assert np.abs(trimmed_mean(messages, 0.1)).max() < 0.2
    assert np.abs(messages.mean(axis=0)).min() > 4.0  # the plain mean is dragged away


def test_trimmed_mean_without_trimming_and_the_mean_rule_are_the_mean():
    messages = np.random.default_rng(1).normal(size=(7, 5))
    np.testing.assert_allclose(trimmed_mean(messages, 0.0), messages.mean(axis=0))
    np.testing.assert_allclose(aggregate(RobustSettings(), messages, 2, np.zeros(5)), messages.mean(axis=0))


def test_norm_clip_bounds_each_change_and_keeps_small_ones():
    reference = np.ones(4)
    messages = reference + np.array([[0.1, 0, 0, 0], [0, 0.2, 0, 0], [30.0, 0, 0, 0]])
    clipped = norm_clip(messages, reference, threshold=1.0)
    np.testing.assert_allclose(clipped, reference + np.array([1.1, 0.2, 0, 0]) / 3)
    default = norm_clip(messages, reference, threshold=None)  # median norm 0.2
    np.testing.assert_allclose(default, reference + np.array([0.3, 0.2, 0, 0]) / 3)


def test_multi_krum_degenerate_sizes():
    one = np.ones((1, 3))
    np.testing.assert_allclose(multi_krum(one, byzantine=0)[0], one[0])
    two = np.array([[0.0, 0.0], [2.0, 2.0]])
    assert len(multi_krum(two, byzantine=1)[1]) == 1


def _system(algorithm: dict, rule: dict, attack: dict, clients: int = 8, per_round: int | None = None):
    partial_personalization = algorithm["name"] in ("fedapm", "fedalt")  # needs a model of several layers
    config = validate_config(
        tiny_config(
            algorithm=algorithm,
            clients={"count": clients, "per_round": per_round},
            attack=attack,
            aggregation=rule,
            model={"name": "mlp" if partial_personalization else "mlr"},
        )
    )
    problem = prepare(config)
    host = make_host(config, problem)
    settings = CoordinatorSettings(
        config.algorithm, problem.params, clients, robust=config.aggregation, attack=config.attack
    )
    coordinator = Coordinator(settings, problem.init_params)
    return problem, host, coordinator


FEDAVG = {"name": "fedavg", "lr": 0.05, "batch_size": 32, "aggregation": "uniform"}
FLAME = {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32}
ATTACK = {"kind": "gaussian", "fraction": 0.25, "std": 100.0}


def test_averaging_server_takes_the_robust_aggregate_of_this_rounds_messages():
    problem, host, coordinator = _system(FEDAVG, {"rule": "median"}, ATTACK)
    partial, _ = host.train(0, host.client_ids, coordinator.broadcast())
    rows = np.stack([partial.messages[c][0] for c in range(8)])
    coordinator.aggregate(partial)
    np.testing.assert_allclose(coordinator.global_model(), np.median(rows, axis=0), atol=1e-6)
    assert np.abs(coordinator.global_model()).max() < 5.0  # the std-100 attackers are outvoted


@pytest.mark.parametrize("rule", ["multi_krum", "median"])
def test_running_sum_server_aggregates_the_latest_messages_of_all_clients(rule):
    """FLAME (delta uploads): w becomes the robust aggregate over the m latest messages, clients not yet
    selected counting with their initial message (the initial model), across partial participation."""
    problem, host, coordinator = _system(FLAME, {"rule": rule}, ATTACK, per_round=4)
    latest = {c: problem.init_params.astype(np.float32) for c in range(8)}
    for round_index, selected in enumerate([[0, 1, 2, 3], [2, 4, 6, 7], [0, 5, 6, 1]]):
        partial, _ = host.train(round_index, selected, coordinator.broadcast())
        latest |= {c: m for c, (m, _) in partial.messages.items()}
        coordinator.aggregate(partial)
        rows = np.stack([latest[c] for c in range(8)])
        expected = aggregate(RobustSettings(rule=rule), rows, len(problem.malicious), np.zeros(1))
        np.testing.assert_allclose(coordinator.global_model(), expected, atol=1e-5)
    if rule == "multi_krum":
        chosen = multi_krum(rows, len(problem.malicious))[1]
        assert not set(chosen.tolist()) & problem.malicious


@pytest.mark.parametrize(
    ("per_round", "fraction", "explicit", "expected_f"),
    [
        (4, 0.25, None, 1),  # floor(0.25 * 4) = 1 of this round's 4 messages, not the 2 attackers of all 8
        (3, 0.5, None, 1),  # the old default, the 4 attackers of all 8 clients, exceeded the 3 messages
        (5, 0.5, None, 2),
        (4, 0.25, 0, 0),  # an explicit aggregation.byzantine still wins
    ],
)
def test_multi_krum_f_follows_the_messages_of_each_aggregation(per_round, fraction, explicit, expected_f):
    """Averaging servers with partial participation: Multi-Krum's default f = floor(attack.fraction * n) for the
    n messages of the round (flame.md 2.6), computed per aggregation by the coordinator."""
    rule = {"rule": "multi_krum", "byzantine": explicit}
    attack = {"kind": "gaussian", "fraction": fraction}
    problem, host, coordinator = _system(FEDAVG, rule, attack, per_round=per_round)
    assert len(problem.malicious) == int(fraction * 8) > expected_f
    selections = [sorted((r * per_round + j) % 8 for j in range(per_round)) for r in range(3)]
    for round_index, selected in enumerate(selections):
        partial, _ = host.train(round_index, selected, coordinator.broadcast())
        rows = np.stack([partial.messages[c][0] for c in sorted(partial.messages)])
        assert len(rows) == per_round
        coordinator.aggregate(partial)
        expected, chosen = multi_krum(rows, expected_f)
        assert len(chosen) == per_round - expected_f
        np.testing.assert_allclose(coordinator.global_model(), expected, atol=1e-6)
        old_default = multi_krum(rows, len(problem.malicious))  # f = attackers among all m clients
        if explicit is None:  # it keeps fewer rows, so a different average
            assert len(old_default[1]) < len(chosen)
            assert not np.allclose(coordinator.global_model(), old_default[0], atol=1e-6)


PARTIAL_AND_PFEDME = [
    {"name": "fedapm", "lr": 0.05, "batch_size": 32, "epochs": 1},  # delta messages of the shared part only
    {"name": "fedalt", "lr": 0.05, "batch_size": 32, "epochs": 1},  # weighted messages of the shared part only
    {"name": "pfedme", "lambda": 1.0, "batch_size": 32, "aggregation": "all"},
    {"name": "pfedme", "lambda": 1.0, "batch_size": 32, "aggregation": "selected"},
]


@pytest.mark.parametrize("algorithm", [FEDAVG, FLAME, *PARTIAL_AND_PFEDME])
def test_a_robust_rule_equal_to_the_mean_reproduces_the_algorithms_own_step(algorithm):
    _, plain_host, plain = _system(algorithm, {"rule": "mean"}, {"kind": "none"}, per_round=5)
    _, host, robust = _system(algorithm, {"rule": "trimmed_mean", "trim_fraction": 0.0}, {"kind": "none"}, per_round=5)
    for round_index, selected in enumerate([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7], [0, 2, 4, 6, 7]]):
        plain.aggregate(plain_host.train(round_index, selected, plain.broadcast())[0])
        robust.aggregate(host.train(round_index, selected, robust.broadcast())[0])
        np.testing.assert_allclose(robust.global_model(), plain.global_model(), atol=1e-6)


def test_robust_aggregation_without_messages_is_refused():
    problem, host, _ = _system(FEDAVG, {"rule": "mean"}, {"kind": "none"})
    fedavg = validate_config(tiny_config(algorithm=FEDAVG)).algorithm
    coordinator = Coordinator(
        CoordinatorSettings(fedavg, problem.params, 8, robust=RobustSettings(rule="median")), problem.init_params
    )
    with pytest.raises(RuntimeError, match="send_messages"):
        coordinator.aggregate(host.train(0, [0, 1], coordinator.broadcast())[0])


def test_config_names_the_rule_and_its_allowed_values():
    with pytest.raises(ConfigError, match="aggregation.rule"):
        validate_config(tiny_config(aggregation={"rule": "krum"}))
    with pytest.raises(ConfigError, match="aggregation.trim_fraction"):
        validate_config(tiny_config(aggregation={"rule": "trimmed_mean", "trim_fraction": 0.5}))


def test_suite_reports_plot_benign_accuracy_against_the_malicious_fraction(tmp_path):
    from raysim.studies.children import ChildOutcome
    from raysim.studies.suite import SuiteChild
    from raysim.tracking.robustness import robustness_points, write_suite_reports

    def child(name, algorithm, attack, acc):
        config = validate_config(tiny_config(algorithm={"name": algorithm}, attack=attack))
        summary = {f"final/{k}/acc": acc + d for k, d in (("pm", 0.0), ("gm", -0.1), ("hm", 0.05))}
        summary |= {f"final/{k}/loss_var": 1.0 - acc for k in ("pm", "gm", "hm")}
        return SuiteChild(name, config, ChildOutcome("finished", summary=summary))

    children = [
        child("flame/clean", "flame", {"kind": "none"}, 0.9),
        child("flame/g/0.5", "flame", {"kind": "gaussian", "fraction": 0.5}, 0.7),
        child("flame/g/0.2", "flame", {"kind": "gaussian", "fraction": 0.2}, 0.8),
        child("flame/s/0.2", "flame", {"kind": "same_value", "fraction": 0.2}, 0.85),
        child("fedavg/clean", "fedavg", {"kind": "none"}, 0.6),
    ]
    lines = robustness_points(children)
    assert [(f, round(a["pm"], 6)) for f, a in lines[("flame", "mean", "gaussian")]] == [
        (0.0, 0.9),
        (0.2, 0.8),
        (0.5, 0.7),
    ]
    assert [f for f, _ in lines[("flame", "mean", "same_value")]] == [0.0, 0.2]
    assert [f for f, _ in lines[("fedavg", "mean", "gaussian")]] == [0.0]
    figures = ["robustness.png", "robustness.pdf", "robustness.svg", "fairness.png", "fairness.pdf", "fairness.svg"]
    assert write_suite_reports(children, "test", tmp_path) == figures
    assert (tmp_path / "robustness.png").stat().st_size > 10_000
    assert (tmp_path / "robustness.pdf").read_bytes().startswith(b"%PDF")
    assert "<svg" in (tmp_path / "robustness.svg").read_text()
    assert write_suite_reports(children[:1] + children[-1:], "clean", tmp_path) == figures[3:]


def test_fairness_labels_overlap_no_label_and_no_marker_and_accuracy_panels_zoom():
    """A crowded fairness scatter (24 runs, most PM/HM points within 0.93-0.98 accuracy, as the shipped compare
    suite): every label's rendered extent is inside the axes and overlaps no other label and no marker."""
    from matplotlib.axes import Axes
    from matplotlib.text import Text

    from raysim.studies.children import ChildOutcome
    from raysim.studies.suite import SuiteChild
    from raysim.tracking import plots
    from raysim.tracking.robustness import fairness_figure

    generator = np.random.default_rng(3)
    config = validate_config(tiny_config())
    children = []
    for index in range(24):
        top = index < 18  # most runs crowd the top right, as personalized models do
        pm = generator.uniform(0.93, 0.98) if top else generator.uniform(0.6, 0.9)
        gm = generator.uniform(0.1, 0.8)
        summary = {"final/pm/acc": pm, "final/hm/acc": pm if index % 2 else pm - 0.01, "final/gm/acc": gm}
        summary |= {f"final/{k}/loss_var": generator.uniform(0, 0.6 if k == "gm" else 0.05) for k in ("pm", "gm", "hm")}
        children.append(SuiteChild(f"algorithm{index}", config, ChildOutcome("finished", summary=summary)))
    figure = fairness_figure(children, "crowded")
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    (axis,) = [a for a in figure.axes if isinstance(a, Axes)]
    labels = [Text.get_window_extent(text, renderer) for text in axis.texts]  # the text alone, not its leader line
    assert len(labels) >= 48  # every run's PM and GM point, and the HM points apart from PM
    frame = axis.get_window_extent(renderer)
    scale = figure.dpi / 72
    markers = []
    for collection in axis.collections:
        (size,) = set(collection.get_sizes())
        half = np.sqrt(size) / 2 * scale
        centres = axis.transData.transform(collection.get_offsets())
        markers += [(x - half, y - half, x + half, y + half) for x, y in centres]
    for i, box in enumerate(labels):
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
        for other in labels[i + 1 :]:
            assert not box.overlaps(other), (axis.texts[i].get_text(), box, other)
        for x0, y0, x1, y1 in markers:
            assert not (box.x0 < x1 and x0 < box.x1 and box.y0 < y1 and y0 < box.y1), axis.texts[i].get_text()

    pm = plots.Panel("PM", [plots.Series("a", {0: 0.1, 1: 0.93, 2: 0.97})], bounds=(0, 1))
    gm = plots.Panel("GM", [plots.Series("a", {0: 0.1, 1: 0.0, 2: 1.0})], bounds=(0, 1))
    fig = plots.round_curves([pm, gm])
    (pm_low, pm_high), (gm_low, gm_high) = (a.get_ylim() for a in fig.axes)
    assert pm_low == pytest.approx(0.93 - 0.002) and pm_high == pytest.approx(0.97 + 0.002)  # round 0 left below
    assert (gm_low, gm_high) == (0.0, 1.0)  # the data spans 0-1: kept, not widened past it

    rounds = range(21)
    fast = plots.Series("fast", {r: 0.1 if r == 0 else 0.95 + 0.001 * r for r in rounds})
    slow = plots.Series("slow", {r: 0.1 + 0.04 * r for r in rounds})  # 0.14 at round 1, 0.9 at round 20
    low = plots.Series("stays low", {r: 0.1 if r == 0 else 0.36 for r in rounds})
    fig = plots.round_curves([plots.Panel("PM", [fast, slow], bounds=(0, 1)), plots.Panel("GM", [fast, low])])
    (pm_low, pm_high), (gm_low, _) = (a.get_ylim() for a in fig.axes)
    span = 0.97 - 0.5  # rounds 10 to 20: the slow method's 0.5 at round 10 to the fast one's 0.97
    assert (pm_low, pm_high) == pytest.approx((0.5 - 0.05 * span, 0.97 + 0.05 * span))  # its start leaves below
    assert gm_low < 0.36  # a method that stays low is in the picture


def test_curves_of_more_settings_than_the_palette_holds_are_each_drawn_differently():
    """The compare suite's 25 settings: tab20 repeats its colours past twenty, so the 21st to 25th settings take a
    line style that the setting of their colour does not have; no two lines of a panel look alike."""
    from matplotlib.colors import to_hex

    from raysim.tracking import plots

    names = [f"method{i}" for i in range(25)]
    colors = plots.setting_colors(names)
    assert colors["method20"] == colors["method0"]  # the palette repeats
    series = [plots.Series(name, {0: 0.1, 1: 0.2 + i / 100}, colors[name]) for i, name in enumerate(names)]
    fig = plots.round_curves([plots.Panel("PM", series), plots.Panel("GM", series[:4])])
    for axis in fig.axes:
        looks = [(to_hex(line.get_color()), line.get_linestyle()) for line in axis.get_lines()]
        assert len(looks) == len(set(looks)), looks
    assert [line.get_linestyle() for line in fig.axes[1].get_lines()] == ["-", "--", ":", "-."]  # as before
