"""Property tests of the partitioners (flame.md 6.3): disjointness, sizes, label counts, determinism, errors."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raysim.data.partitions import (
    DirichletSettings,
    HybridSettings,
    IIDSettings,
    LabelPriorSettings,
    MixedSettings,
    NaturalSettings,
    QLabelSettings,
    QualitySettings,
    QuantitySettings,
    label_counts,
    partition_dataset,
)
from raysim.errors import PartitionError
from raysim.seeding import Stream, rng

fast = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _labels(num_classes: int, per_class: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def _owned(split) -> np.ndarray:
    return np.concatenate([split.train, split.test, split.val])


def _all(splits) -> np.ndarray:
    return np.concatenate([_owned(s) for s in splits])


disjoint_schemes = st.sampled_from(
    [
        IIDSettings(),
        DirichletSettings(beta=0.5),
        QLabelSettings(q=2),
        QualitySettings(),
        QuantitySettings(min_samples=5),
        HybridSettings(min_samples=5),
        MixedSettings(iid_fraction=0.3),
        IIDSettings(val_fraction=0.2),
    ]
)


@fast
@given(scheme=disjoint_schemes, clients=st.integers(2, 12), seed=st.integers(0, 10_000))
def test_disjoint_schemes_assign_every_sample_at_most_once(scheme, clients, seed):
    labels = _labels(5, 60, seed)
    splits = partition_dataset(labels, clients, scheme, seed)
    everything = _all(splits)
    assert len(splits) == clients
    assert len(np.unique(everything)) == len(everything)
    assert everything.min() >= 0 and everything.max() < len(labels)
    for split in splits:
        assert len(split.train) >= 1 and len(split.test) == max(1, round(0.2 * split.num_samples))
        assert len(np.intersect1d(split.train, split.test)) == 0
    if not isinstance(scheme, QLabelSettings | HybridSettings):  # q-label may leave spare shards unused
        assert len(everything) == len(labels)


@fast
@given(scheme=disjoint_schemes, clients=st.integers(2, 8), seed=st.integers(0, 10_000))
def test_same_seed_same_partition(scheme, clients, seed):
    labels = _labels(4, 50, 3)
    first = partition_dataset(labels, clients, scheme, seed)
    second = partition_dataset(labels, clients, scheme, seed)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test) and a.noise_std == b.noise_std


def test_different_seeds_give_different_partitions():
    labels = _labels(4, 50, 3)
    a = partition_dataset(labels, 5, DirichletSettings(), 1)
    b = partition_dataset(labels, 5, DirichletSettings(), 2)
    assert any(not np.array_equal(x.train, y.train) for x, y in zip(a, b, strict=True))


@fast
@given(clients=st.integers(1, 20), seed=st.integers(0, 10_000))
def test_iid_sizes_differ_by_at_most_one(clients, seed):
    splits = partition_dataset(_labels(3, 70, seed), clients, IIDSettings(), seed)
    sizes = [s.num_samples for s in splits]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 210


@fast
@given(q=st.integers(1, 4), clients=st.integers(2, 15), classes=st.integers(2, 10), seed=st.integers(0, 10_000))
def test_q_label_clients_hold_at_most_q_classes_in_q_equal_shards(q, clients, classes, seed):
    labels = _labels(classes, 80, seed)
    splits = partition_dataset(labels, clients, QLabelSettings(q=q), seed)
    shards_per_class = math.ceil(q * clients / classes)
    for split in splits:
        owned = _owned(split)
        assert len(np.unique(labels[owned])) <= q
        # q shards of one class-size split: each shard has floor or ceil of 80 / shards_per_class samples
        assert q * (80 // shards_per_class) <= len(owned) <= q * math.ceil(80 / shards_per_class)


@fast
@given(clients=st.integers(2, 10), beta=st.floats(0.1, 5.0), min_samples=st.integers(2, 20), seed=st.integers(0, 999))
def test_quantity_skew_sizes(clients, beta, min_samples, seed):
    labels = _labels(3, 100, seed)
    splits = partition_dataset(labels, clients, QuantitySettings(beta=beta, min_samples=min_samples), seed)
    sizes = np.array([s.num_samples for s in splits])
    assert sizes.min() >= min_samples and sizes.sum() == 300


OVERLAPPING = (
    DirichletSettings(beta=5.0, overlap=True),  # beta 5: no client is left (nearly) empty, so nothing is skipped
    QuantitySettings(min_samples=10, overlap=True),
    HybridSettings(min_samples=10, overlap=True),
)


@fast
@given(clients=st.integers(2, 8), seed=st.integers(0, 999))
def test_overlapping_modes_never_repeat_a_sample_within_a_client(clients, seed):
    labels = _labels(4, 60, seed)
    checked = 0
    for scheme in OVERLAPPING:
        splits = partition_dataset(labels, clients, scheme, seed)
        assert len(splits) == clients
        for split in splits:
            assert split.num_samples >= 2 and len(np.unique(_owned(split))) == split.num_samples
        checked += 1
    assert checked == len(OVERLAPPING)


def test_overlapping_dirichlet_takes_int_share_of_every_class_and_reuses_samples():
    labels = _labels(5, 200, 0)
    splits = partition_dataset(labels, 6, DirichletSettings(beta=5.0, overlap=True), 4)
    everything = _all(splits)
    assert len(np.unique(everything)) < len(everything)  # the authors' code shares samples across clients
    disjoint = _all(partition_dataset(labels, 6, DirichletSettings(beta=5.0), 4))
    assert len(np.unique(disjoint)) == len(disjoint) == len(labels)


def test_hybrid_gives_ceil_half_q_label_clients_and_floor_half_quantity_clients():
    labels = _labels(10, 100, 1)
    splits = partition_dataset(labels, 7, HybridSettings(q=2, min_samples=20), 5)
    label_half, quantity_half = splits[:4], splits[4:]
    assert all(len(np.unique(labels[_owned(s)])) <= 2 for s in label_half)
    assert all(s.num_samples >= 20 for s in quantity_half)
    # the disjoint version splits the samples between the halves in proportion 4:3 before partitioning
    assert sum(s.num_samples for s in quantity_half) == 1000 - round(1000 * 4 / 7)


def test_mixed_fraction_one_is_iid_and_zero_is_label_skew():
    labels = _labels(10, 100, 1)
    iid_like = partition_dataset(labels, 10, MixedSettings(iid_fraction=1.0), 2)
    skewed = partition_dataset(labels, 10, MixedSettings(iid_fraction=0.0, beta=0.1), 2)

    def spread(splits):  # mean over clients of the largest class share
        return np.mean([np.bincount(labels[_owned(s)], minlength=10).max() / s.num_samples for s in splits])

    assert spread(iid_like) < 0.3 < spread(skewed)


@pytest.mark.parametrize(("scale", "expected"), [("variance", math.sqrt(0.1 * 3 / 4)), ("std", 0.1 * 3 / 4)])
def test_quality_skew_noise_scales_with_client_index(scale, expected):
    splits = partition_dataset(_labels(2, 40, 0), 4, QualitySettings(sigma=0.1, noise_scale=scale), 0)
    assert splits[0].noise_std == 0.0
    assert splits[3].noise_std == pytest.approx(expected)
    assert [s.noise_std for s in splits] == sorted(s.noise_std for s in splits)


def test_natural_split_deals_whole_groups_contiguously():
    groups = np.repeat(np.arange(11), 10)
    labels = np.zeros(110, dtype=np.int64)
    splits = partition_dataset(labels, 3, NaturalSettings(), 0, groups=groups)
    held = [sorted(set(groups[_owned(s)])) for s in splits]
    assert held == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # 11 // 3 = 3 groups each; groups 9, 10 unused


def test_label_counts_match_the_splits():
    labels = _labels(4, 30, 0)
    splits = partition_dataset(labels, 5, DirichletSettings(), 0)
    counts = label_counts(splits, labels, 4)
    assert counts["train"].shape == (5, 4)
    assert [int(c.sum()) for c in counts["train"]] == [len(s.train) for s in splits]
    assert int(sum(c.sum() for c in counts.values())) == len(labels)


@pytest.mark.parametrize(
    ("scheme", "clients", "groups", "message"),
    [
        (QLabelSettings(q=6), 50, None, "partition.q=6"),
        (QuantitySettings(min_samples=100), 5, None, "partition.min_samples=100"),
        (QuantitySettings(min_samples=300, overlap=True), 5, None, "partition.min_samples=300"),
        (NaturalSettings(), 3, None, "group id"),
        (NaturalSettings(), 5, np.repeat(np.arange(4), 30), "fewer than clients.count=5"),
        (DirichletSettings(beta=0.01, min_samples=20), 12, None, "partition.beta=0.01"),
        (IIDSettings(), 100, None, "clients.count=100"),
    ],
)
def test_impossible_requests_fail_with_the_config_field(scheme, clients, groups, message):
    labels = _labels(4, 30, 0)
    with pytest.raises(PartitionError, match=message.replace(".", r"\.")):
        partition_dataset(labels, clients, scheme, 0, groups=groups)


def test_label_schemes_reject_regression_targets():
    with pytest.raises(PartitionError, match="partition.scheme=dirichlet"):
        partition_dataset(np.linspace(0, 1, 100).astype(np.float32), 4, DirichletSettings(), 0)
    assert len(partition_dataset(np.linspace(0, 1, 100).astype(np.float32), 4, IIDSettings(), 0)) == 4


def _groups(num_groups: int, per_group: int, seed: int) -> np.ndarray:
    """Shuffled, non-contiguous group ids (writers) with gaps: 0, 3, 6, ..."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_groups) * 3, per_group))


def _same(first, second) -> bool:
    return all(
        np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test) and np.array_equal(a.val, b.val)
        for a, b in zip(first, second, strict=True)
    )


@fast
@given(
    scheme=st.sampled_from([*OVERLAPPING, NaturalSettings(), NaturalSettings(val_fraction=0.2)]),
    clients=st.integers(2, 8),
    seed=st.integers(0, 10_000),
)
def test_overlapping_and_natural_schemes_are_deterministic_by_seed(scheme, clients, seed):
    labels, groups = _labels(4, 60, 1), _groups(24, 10, 1)
    first = partition_dataset(labels, clients, scheme, seed, groups=groups)
    assert _same(first, partition_dataset(labels, clients, scheme, seed, groups=groups))
    other = partition_dataset(labels, clients, scheme, seed + 1, groups=groups)
    assert not _same(first, other)  # the draws (or, for natural, the per-client splits) follow the seed
    if isinstance(scheme, NaturalSettings):  # who holds which writer does not depend on the seed
        assert [sorted(_owned(a)) for a in first] == [sorted(_owned(b)) for b in other]


@fast
@given(clients=st.integers(1, 12), groups_count=st.integers(12, 40), seed=st.integers(0, 10_000))
def test_natural_deals_whole_groups_in_sorted_runs(clients, groups_count, seed):
    groups = _groups(groups_count, 5, seed)
    labels = np.zeros(len(groups), dtype=np.int64)
    splits = partition_dataset(labels, clients, NaturalSettings(), seed, groups=groups)
    ids = np.unique(groups)
    per_client = groups_count // clients
    for client, split in enumerate(splits):
        owned = _owned(split)
        expected = ids[client * per_client : (client + 1) * per_client]
        assert sorted(set(groups[owned])) == expected.tolist()  # contiguous run of sorted ids
        assert len(owned) == 5 * per_client == len(np.unique(owned))  # whole groups, once each
    everything = _all(splits)
    assert len(np.unique(everything)) == len(everything) == 5 * per_client * clients  # leftover groups unused


def _dirichlet_counts(labels: np.ndarray, clients: int, beta: float, min_samples: int, seed: int) -> np.ndarray:
    """The label counts the paper's draw implies (flame.md 6.3 scheme 2): per class k, p_k ~ Dir(beta) from the
    partition stream, client i gets the i-th cut of class k; redrawn while a client holds < min_samples."""
    generator = rng(seed, Stream.PARTITION)
    classes = np.unique(labels)
    while True:
        counts = np.zeros((clients, len(classes)), dtype=np.int64)
        for j, k in enumerate(classes):
            size = int((labels == k).sum())
            generator.permutation(size)  # the class's shuffle, same stream use
            cuts = (np.cumsum(generator.dirichlet(np.full(clients, beta)))[:-1] * size).astype(int)
            counts[:, j] = np.diff(np.concatenate([[0], cuts, [size]]))
        if counts.sum(axis=1).min() >= min_samples:
            return counts


@fast
@given(clients=st.integers(2, 10), beta=st.floats(0.05, 10.0), classes=st.integers(2, 6), seed=st.integers(0, 999))
def test_dirichlet_label_counts_are_the_drawn_shares_of_every_class(clients, beta, classes, seed):
    labels = _labels(classes, 50, seed)
    try:
        splits = partition_dataset(labels, clients, DirichletSettings(beta=beta), seed)
    except PartitionError as error:  # 100 draws all left a client below min_samples: only at small beta
        assert "partition.min_samples=2" in str(error) and beta < 1.0
        return
    held = label_counts(splits, labels, classes)
    owned = sum(held.values())
    np.testing.assert_array_equal(owned, _dirichlet_counts(labels, clients, beta, 2, seed))
    np.testing.assert_array_equal(owned.sum(axis=0), np.bincount(labels))  # every sample exactly once
    everything = _all(splits)
    assert len(np.unique(everything)) == len(everything) == len(labels)
    for client, split in enumerate(splits):  # the label set a client holds is the classes of its nonzero cuts
        assert set(labels[_owned(split)]) == set(np.flatnonzero(owned[client]))


@fast
@given(clients=st.integers(2, 8), beta=st.floats(0.5, 10.0), seed=st.integers(0, 999))
def test_overlapping_dirichlet_takes_the_int_share_of_each_class(clients, beta, seed):
    labels = _labels(4, 60, seed)
    generator = rng(seed, Stream.PARTITION)
    shares = generator.dirichlet(np.full(clients, beta), size=4)  # (classes, clients), drawn first
    expected = (shares * 60).astype(int)
    settings = DirichletSettings(beta=beta, overlap=True, min_samples=2)
    if expected.sum(axis=0).min() < 2:  # one draw, no retry: a client short of min_samples is an error
        with pytest.raises(PartitionError, match="partition.min_samples=2"):
            partition_dataset(labels, clients, settings, seed)
        return
    splits = partition_dataset(labels, clients, settings, seed)
    for client, split in enumerate(splits):
        counts = np.bincount(labels[_owned(split)], minlength=4)
        np.testing.assert_array_equal(counts, expected[:, client])


@fast
@given(
    clients=st.integers(2, 10),
    iid_fraction=st.floats(0.0, 1.0),
    beta=st.floats(0.3, 5.0),
    seed=st.integers(0, 999),
)
def test_mixed_deals_the_promised_iid_share_and_splits_the_rest_by_label(clients, iid_fraction, beta, seed):
    labels = _labels(5, 60, seed)
    try:
        splits = partition_dataset(labels, clients, MixedSettings(iid_fraction=iid_fraction, beta=beta), seed)
    except PartitionError as error:
        assert "partition.min_samples" in str(error)
        return
    shuffled = rng(seed, Stream.PARTITION).permutation(len(labels))  # the IID share is dealt first
    cut = round(iid_fraction * len(labels))
    iid_parts = np.array_split(shuffled[:cut], clients)
    rest = set(shuffled[cut:].tolist())
    everything = _all(splits)
    assert len(np.unique(everything)) == len(everything) == len(labels)
    for split, iid_part in zip(splits, iid_parts, strict=True):
        owned = set(_owned(split).tolist())
        assert set(iid_part.tolist()) <= owned  # the client's IID share: |cut| / m (+-1) samples
        assert owned - set(iid_part.tolist()) <= rest  # the skewed part comes from the rest only
    sizes = [len(p) for p in iid_parts]
    assert sum(sizes) == cut and max(sizes) - min(sizes) <= 1


@fast
@given(
    clients=st.integers(2, 9),
    q=st.integers(1, 3),
    min_samples=st.integers(2, 15),
    overlap=st.booleans(),
    seed=st.integers(0, 999),
)
def test_hybrid_halves_have_their_promised_shapes(clients, q, min_samples, overlap, seed):
    labels = _labels(6, 80, seed)
    splits = partition_dataset(labels, clients, HybridSettings(q=q, min_samples=min_samples, overlap=overlap), seed)
    label_clients = math.ceil(clients / 2)
    label_half, quantity_half = splits[:label_clients], splits[label_clients:]
    assert len(quantity_half) == clients // 2
    assert all(len(np.unique(labels[_owned(s)])) <= q for s in label_half)
    assert all(s.num_samples >= min_samples for s in quantity_half)
    for split in splits:
        assert len(np.unique(_owned(split))) == split.num_samples
    if overlap:
        return
    everything = _all(splits)
    assert len(np.unique(everything)) == len(everything)  # disjoint across both halves
    cut = round(len(labels) * label_clients / clients)  # the samples are split between the halves first
    assert sum(s.num_samples for s in quantity_half) == len(labels) - cut
    assert sum(s.num_samples for s in label_half) <= cut


def _prior_parts(splits) -> list[np.ndarray]:
    """What label_prior dealt each client to train on (train + validation)."""
    return [np.concatenate([s.train, s.val]) for s in splits]


@fast
@given(
    clients=st.integers(1, 12),
    alpha=st.floats(0.01, 10.0),
    refill=st.booleans(),
    test_samples=st.integers(10, 40),
    val_fraction=st.sampled_from([0.0, 0.25]),
    seed=st.integers(0, 10_000),
)
def test_label_prior_sizes_test_sets_and_repeats(clients, alpha, refill, test_samples, val_fraction, seed):
    labels = _labels(4, 150, seed)
    scheme = LabelPriorSettings(
        alpha=alpha, refill=refill, test_samples=test_samples, test_fraction=0.4, val_fraction=val_fraction
    )
    splits = partition_dataset(labels, clients, scheme, seed)
    pool = len(labels) - round(0.4 * len(labels))
    parts = _prior_parts(splits)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == pool and max(sizes) - min(sizes) <= 1  # balanced N/M over the training pool
    trained = np.concatenate(parts)
    tested = np.concatenate([s.test for s in splits])
    assert not set(trained.tolist()) & set(tested.tolist())  # test samples come from the held-out pool
    assert len(np.unique(tested)) <= round(0.4 * len(labels))
    if not refill:
        assert len(np.unique(trained)) == len(trained)  # paper: no sample repeats
    for split, part in zip(splits, parts, strict=True):
        counts = np.bincount(labels[part], minlength=4)
        expected = counts * test_samples // len(part)  # floor(share * test_samples) per label
        np.testing.assert_array_equal(np.bincount(labels[split.test], minlength=4), expected)
        assert len(np.unique(split.test)) == len(split.test) <= test_samples
        assert len(split.train) >= 1 and (val_fraction == 0) == (len(split.val) == 0)
    assert _same(splits, partition_dataset(labels, clients, scheme, seed))


def test_label_prior_follows_each_clients_prior_and_refills_only_in_code_mode():
    """A scarce class: the paper's split uses each of its samples once, then renormalizes the priors over the
    classes left; the authors' code refills the pool, so the scarce samples repeat."""
    labels = np.concatenate([np.zeros(40, np.int64), np.ones(600, np.int64), np.full(600, 2, np.int64)])
    labels = np.random.default_rng(0).permutation(labels)
    paper = partition_dataset(labels, 6, LabelPriorSettings(alpha=50.0, test_samples=10), 3)
    code = partition_dataset(labels, 6, LabelPriorSettings(alpha=50.0, test_samples=10, refill=True), 3)
    paper_zeros = np.concatenate([p[labels[p] == 0] for p in _prior_parts(paper)])
    code_zeros = np.concatenate([p[labels[p] == 0] for p in _prior_parts(code)])
    held_out = rng(3, Stream.PARTITION).permutation(len(labels))[: round(0.2 * len(labels))]
    pool_zeros = 40 - int((labels[held_out] == 0).sum())
    assert len(paper_zeros) == len(np.unique(paper_zeros)) == pool_zeros  # each scarce sample once, all used
    assert len(code_zeros) > 200 and len(np.unique(code_zeros)) <= pool_zeros  # about a third of 992 draws
    # with near-uniform priors the two plentiful classes share what class 0 could not give
    ones = [np.mean(labels[p] == 1) for p in _prior_parts(paper)]
    assert all(0.4 < share < 0.6 for share in ones)


def test_label_prior_with_a_small_alpha_gives_skewed_clients():
    labels = _labels(10, 200, 0)
    splits = partition_dataset(labels, 10, LabelPriorSettings(alpha=0.1, test_samples=20), 0)
    top = [np.bincount(labels[p], minlength=10).max() / len(p) for p in _prior_parts(splits)]
    uniform = partition_dataset(labels, 10, LabelPriorSettings(alpha=1000.0, test_samples=20), 0)
    flat = [np.bincount(labels[p], minlength=10).max() / len(p) for p in _prior_parts(uniform)]
    assert np.mean(top) > 0.5 > 0.2 > np.mean(flat)


@pytest.mark.parametrize(
    ("scheme", "clients", "message"),
    [
        (LabelPriorSettings(test_fraction=0.9), 50, "partition.test_fraction=0.9"),
        (LabelPriorSettings(test_samples=500, test_fraction=0.05), 4, "partition.test_samples=500: client"),
        (LabelPriorSettings(test_samples=1, alpha=1000.0), 4, "partition.test_samples=1 gives client 0 no test"),
        (LabelPriorSettings(val_fraction=0.5, test_fraction=0.5, test_samples=10), 60, "partition.val_fraction=0.5"),
    ],
)
def test_label_prior_impossible_requests_name_the_setting(scheme, clients, message):
    labels = _labels(4, 30, 0)
    with pytest.raises(PartitionError, match=re.escape(message)) as error:
        partition_dataset(labels, clients, scheme, 0)
    assert "\n" not in str(error.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.fixed_dictionaries(
        {},
        optional={
            "alpha": st.floats(1e-4, 1e4),
            "refill": st.booleans(),
            "test_samples": st.integers(1, 500),
            "test_fraction": st.floats(0.01, 0.99),
            "val_fraction": st.sampled_from([0.0, 0.1, 0.5, 0.9]),
        },
    ),
    clients=st.integers(1, 40),
    classes=st.integers(1, 6),
    size=st.integers(0, 200),
)
def test_label_prior_answers_any_request_with_splits_or_one_error_line(fields, clients, classes, size):
    labels = np.random.default_rng(size).integers(0, classes, size)
    try:
        splits = partition_dataset(labels, clients, LabelPriorSettings(**fields), 1)
    except PartitionError as error:
        assert str(error).startswith(("partition.", "clients.count=", "client ")) and "\n" not in str(error)
        return
    assert len(splits) == clients
    for split in splits:
        assert len(split.train) >= 1 and len(split.test) >= 1
        assert not set(split.test.tolist()) & set(np.concatenate([s.train for s in splits]).tolist())


def test_label_prior_clients_train_and_are_scored_on_their_own_test_sets():
    """Through prepare() and the real host and coordinator: the per-client test sets are what is scored."""
    from raysim.config import validate_config
    from raysim.evaluation.columns import client_evaluations
    from tests.support.experiments import tiny_config
    from tests.support.inprocess import InProcess

    config = validate_config(
        tiny_config(partition={"scheme": "label_prior", "alpha": 0.3, "test_samples": 40}, clients={"count": 8})
    )
    run = InProcess(config)
    for round_index in range(2):
        run.round(round_index)
    evaluations = client_evaluations(run.host.evaluate(run.coordinator.global_model()))
    splits = {split.client_id: split for _, split in run.problem.clients}
    assert len(evaluations) == 8
    for evaluation in evaluations:
        test = splits[evaluation.client_id].test
        assert 37 <= len(test) <= 40  # floor(share * 40) per label: up to (labels held - 1) short of 40
        assert 0.0 <= evaluation.pm.test_acc <= 1.0
        assert evaluation.pm.test_acc * len(test) == pytest.approx(round(evaluation.pm.test_acc * len(test)))
