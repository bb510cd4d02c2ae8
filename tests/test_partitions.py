"""Property tests of the partitioners (flame.md 6.3): disjointness, sizes, label counts, determinism, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raysim.data.partitions import (
    DirichletSettings,
    HybridSettings,
    IIDSettings,
    MixedSettings,
    NaturalSettings,
    QLabelSettings,
    QualitySettings,
    QuantitySettings,
    label_counts,
    partition_dataset,
)
from raysim.errors import PartitionError

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


@fast
@given(clients=st.integers(2, 8), seed=st.integers(0, 999))
def test_overlapping_modes_never_repeat_a_sample_within_a_client(clients, seed):
    labels = _labels(4, 60, seed)
    for scheme in (
        DirichletSettings(beta=1.0, overlap=True),
        QuantitySettings(min_samples=10, overlap=True),
        HybridSettings(min_samples=10, overlap=True),
    ):
        try:
            splits = partition_dataset(labels, clients, scheme, seed)
        except PartitionError:
            continue  # an overlapping Dirichlet draw may leave a client nearly empty
        for split in splits:
            assert len(np.unique(_owned(split))) == split.num_samples


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
