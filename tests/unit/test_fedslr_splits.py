"""FedSLR's Table 1 splits as the paper deals them (fedslr.md 6.1): the clients share the official training set
(N/M = 500 CIFAR samples each), and each is scored on `test_samples` drawn from the official test set with its own
training label shares, floor(share * 100) per label: `label_prior` (non-IID) and `iid` with `test_split: matched`
(IID), both with `test_pool: official`, which reads where the dataset's test set begins (Dataset.test_start)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from raysim.data.cifar import Cifar10Settings, Cifar100Settings
from raysim.data.image_folder import TinyImagenetSettings
from raysim.data.partitions import DirichletSettings, IIDSettings, LabelPriorSettings, partition_dataset
from raysim.errors import PartitionError
from tests.support.data_files import write_tiny_imagenet
from tests.support.paper_data import cifar10, cifar100_few_classes

CIFAR_LIKE = 50_000
"""The official CIFAR training set; 10,000 test images follow it in the pooled data."""


def _cifar_like_labels(classes: int, seed: int = 0) -> np.ndarray:
    """60,000 labels, balanced in both the training part and the test part, each part shuffled."""
    generator = np.random.default_rng(seed)
    train = generator.permutation(np.arange(CIFAR_LIKE) % classes)
    test = generator.permutation(np.arange(10_000) % classes)
    return np.concatenate([train, test]).astype(np.int64)


def _check_matched(labels: np.ndarray, split, test_samples: int, classes: int) -> None:
    """The test set holds floor(share * test_samples) of every label the client trains on, from the test set."""
    trained = np.concatenate([split.train, split.val])
    counts = np.bincount(labels[trained], minlength=classes)
    expected = counts * test_samples // len(trained)
    np.testing.assert_array_equal(np.bincount(labels[split.test], minlength=classes), expected)
    assert split.test.min() >= CIFAR_LIKE and trained.max() < CIFAR_LIKE
    assert len(np.unique(split.test)) == len(split.test)


@pytest.mark.parametrize("classes", [10, 100])
def test_non_iid_clients_hold_500_official_training_samples_and_label_matched_official_tests(classes):
    labels = _cifar_like_labels(classes)
    scheme = LabelPriorSettings(alpha=0.1, test_pool="official")
    splits = partition_dataset(labels, 100, scheme, 1, test_start=CIFAR_LIKE)
    assert [len(s.train) for s in splits] == [500] * 100  # N/M of the official training set, not 480 of the pool
    trained = np.concatenate([s.train for s in splits])
    assert np.array_equal(np.sort(trained), np.arange(CIFAR_LIKE))  # the paper: every training sample, once
    for split in splits:
        _check_matched(labels, split, 100, classes)
    skew = np.mean([np.bincount(labels[s.train]).max() / 500 for s in splits])
    assert skew > 5 / classes  # Dir(0.1) priors: a client's largest label is far above the IID share 1/C
    held_out = partition_dataset(labels, 100, LabelPriorSettings(alpha=0.1), 1)
    assert [len(s.train) for s in held_out] == [480] * 100  # the held-out default: 80 % of the 60,000 pooled


def test_iid_clients_share_the_official_training_set_equally_with_label_matched_official_tests():
    labels = _cifar_like_labels(100)
    scheme = IIDSettings(test_split="matched", test_pool="official")
    splits = partition_dataset(labels, 100, scheme, 2, test_start=CIFAR_LIKE)
    assert [len(s.train) for s in splits] == [500] * 100 and not any(len(s.val) for s in splits)
    assert np.array_equal(np.sort(np.concatenate([s.train for s in splits])), np.arange(CIFAR_LIKE))
    for split in splits:
        _check_matched(labels, split, 100, 100)
        assert 100 - len(np.unique(labels[split.train])) <= len(split.test) <= 100  # floor per label: a few short
    tiny = partition_dataset(
        labels, 100, IIDSettings(test_split="matched", test_pool="official", test_samples=500), 2, test_start=CIFAR_LIKE
    )
    for split in tiny:  # the authors' Tiny-ImageNet IID: 500 test samples a client
        _check_matched(labels, split, 500, 100)
    again = partition_dataset(labels, 100, scheme, 2, test_start=CIFAR_LIKE)
    assert all(
        np.array_equal(a.test, s.test) and np.array_equal(a.train, s.train) for a, s in zip(again, splits, strict=True)
    )


def test_matched_tests_from_a_held_out_pool_and_a_global_official_test_split():
    """The same two settings work for any scheme: matched tests from a held-out share, or everyone scored on the
    whole official test set."""
    labels = _cifar_like_labels(10)[::20]  # 3,000 labels, test part from 2,500 on
    matched = partition_dataset(labels, 10, DirichletSettings(beta=0.5, test_split="matched", test_samples=30), 4)
    trained = np.concatenate([np.concatenate([s.train, s.val]) for s in matched])
    tested = np.concatenate([s.test for s in matched])
    assert not set(trained.tolist()) & set(tested.tolist()) and len(trained) == 3000 - 600
    for split in matched:
        counts = np.bincount(labels[np.concatenate([split.train, split.val])], minlength=10)
        np.testing.assert_array_equal(np.bincount(labels[split.test], minlength=10), counts * 30 // counts.sum())
    shared = partition_dataset(
        labels, 10, DirichletSettings(test_split="global", test_pool="official"), 4, test_start=2500
    )
    assert all(np.array_equal(s.test, np.arange(2500, 3000)) for s in shared)
    assert np.concatenate([s.train for s in shared]).max() < 2500


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: IIDSettings(test_pool="official"), "partition.test_pool=official is the test pool of test_split"),
        (lambda: IIDSettings(test_split="matched", draw="authors"), "partition.test_split=matched: partition.draw"),
        (
            lambda: LabelPriorSettings(test_split="matched"),
            "partition.test_split=matched: partition.scheme=label_prior",
        ),
    ],
)
def test_settings_the_official_pool_cannot_serve_are_refused_naming_the_field(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_a_dataset_without_an_official_test_set_is_refused_in_one_line():
    labels = np.arange(200) % 4
    for scheme in (LabelPriorSettings(test_pool="official"), IIDSettings(test_split="matched", test_pool="official")):
        with pytest.raises(
            PartitionError, match=re.escape("partition.test_pool=official: this dataset has no")
        ) as error:
            partition_dataset(labels, 4, scheme, 0)
        assert "\n" not in str(error.value)
    with pytest.raises(PartitionError, match="official training set holds 3 samples, fewer than clients.count=4"):
        partition_dataset(labels, 4, LabelPriorSettings(test_pool="official"), 0, test_start=3)


def test_the_loaders_record_where_the_official_test_set_begins(tmp_path):
    cifar10(tmp_path / "c10")
    data = Cifar10Settings(root=str(tmp_path / "c10")).load(0)
    assert data.test_start == 300 and len(data) == 360  # five batches of 60, then the test batch
    cifar100_few_classes(tmp_path / "c100")
    data = Cifar100Settings(root=str(tmp_path / "c100")).load(0)
    assert data.test_start == 160 and len(data) == 200
    write_tiny_imagenet(tmp_path / "tiny", per_class=4, val_per_class=2)
    data = TinyImagenetSettings(root=str(tmp_path / "tiny")).load(0)
    assert data.test_start == 12 and len(data) == 18
    splits = partition_dataset(data.y, 2, LabelPriorSettings(test_pool="official", test_samples=4), 0, test_start=12)
    assert all(s.train.max() < 12 <= s.test.min() for s in splits)
