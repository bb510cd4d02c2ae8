"""CrisisMMD as the FedAPM authors split it, on the offline substitute (raysim.data.substitutes): their 20 client
files, dealt from the train split by FedMultimodal's Dirichlet partition (fedapm.md 4.1), and their test.pkl, the
official test set every client is scored on; and the Table 3 and Table 4 CrisisMMD suites that deal it so."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data.partitions import partition_dataset
from raysim.data.substitutes import CrisisMMDSyntheticSettings, deal_client_files
from raysim.errors import DataError
from raysim.studies.suite import load_suite
from tests.support.fedapm import SUITES
from tests.support.paper_data import BUILT_IN

SMALL = {"samples": 300, "image_dim": 24, "text_dim": 8, "tokens": 6}
"""The substitute's shapes made small (the split does not depend on them)."""


def authors_partition(labels: np.ndarray, files: int, beta: float, generator: np.random.Generator) -> list[list]:
    """The authors' partition_manager.direchlet_partition (FedMultimodal's), written again from its definition with
    `generator` for their global np.random: per class, shares ~ Dir(beta), a file's share zeroed once it holds N /
    files samples, renormalized, the shuffled class cut at int(cumsum * size)[:-1]; redrawn until no file is empty."""
    n = len(labels)
    while True:
        held: list[list] = [[] for _ in range(files)]
        for k in range(int(labels.max()) + 1):
            members = generator.permutation(np.where(labels == k)[0])
            proportions = generator.dirichlet(np.repeat(beta, files))
            proportions = np.array([p * (len(h) < n / files) for p, h in zip(proportions, held, strict=True)])
            proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(members)).astype(int)[:-1]
            held = [h + part.tolist() for h, part in zip(held, np.split(members, cuts), strict=True)]
        if min(len(h) for h in held) >= 1:
            return held


def test_the_client_files_are_the_authors_dirichlet_deal_replayed():
    labels = np.random.default_rng(0).integers(0, 8, size=500)
    files = deal_client_files(labels, 20, 1.0, np.random.default_rng(7))
    replayed = authors_partition(labels, 20, 1.0, np.random.default_rng(7))
    assert [sorted(np.flatnonzero(files == f).tolist()) for f in range(20)] == [sorted(h) for h in replayed]


def test_the_deal_holds_its_balance_rule_and_its_limits():
    """Every sample in one file, none empty; a file stops taking samples once it holds N / F, so none ends above
    N / F plus the largest class; with beta -> infinity every class is cut into equal shares; one file takes all."""
    labels = np.random.default_rng(1).integers(0, 8, size=2000)
    sizes = np.bincount(deal_client_files(labels, 20, 0.1, np.random.default_rng(2)), minlength=20)
    assert sizes.sum() == 2000 and sizes.min() >= 1
    assert sizes.max() < 2000 / 20 + np.bincount(labels).max()
    even = deal_client_files(labels, 20, 1e9, np.random.default_rng(3))
    for k, size in enumerate(np.bincount(labels)):
        counts = np.bincount(even[labels == k], minlength=20)
        assert counts.min() >= size // 20 - 1 and counts.max() <= size // 20 + 2, k
    assert (deal_client_files(labels, 1, 1.0, np.random.default_rng(4)) == 0).all()


def test_the_substitute_keeps_an_official_test_set_sized_as_test_pkl_and_groups_by_file():
    """test / train = 2,237 / 13,608 (the authors' test.pkl against their client files), the test samples last
    with group -1 as the converted test.pkl's, the training samples in the 20 files; seeded."""
    data = CrisisMMDSyntheticSettings(**SMALL).load(5)
    assert data.test_start == 300 - round(300 * 0.1644 / 1.1644) == 258
    assert abs((300 - data.test_start) / data.test_start - 2237 / 13608) < 0.01
    assert data.groups is not None and (data.groups[data.test_start :] == -1).all()
    assert sorted(np.unique(data.groups[: data.test_start])) == list(range(20))
    again = CrisisMMDSyntheticSettings(**SMALL).load(5)
    np.testing.assert_array_equal(data.x, again.x)
    np.testing.assert_array_equal(data.groups, again.groups)
    pooled = CrisisMMDSyntheticSettings(**SMALL, test_ratio=0).load(5)
    assert pooled.test_start is None and pooled.groups is not None and (pooled.groups >= 0).all()


def test_too_few_samples_for_the_files_is_refused_in_one_line():
    with pytest.raises(DataError) as refused:
        CrisisMMDSyntheticSettings(**{**SMALL, "samples": 20}).load(1)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("dataset.samples=20: 17 training samples")


@pytest.mark.parametrize("table", [3, 4])
def test_the_crisismmd_suites_deal_one_file_per_client_all_scored_on_the_official_test_set(table):
    """The suite's own partition on the (small) substitute: client c trains on client file c alone, every sample of
    it, and is scored on the official test set [test_start, n)."""
    suite = load_suite(SUITES / f"fedapm_table{table}_crisismmd.yaml", BUILT_IN["crisismmd_synthetic"])
    _name, config = suite.experiments()[0]
    assert config.partition.scheme == "natural" and config.partition.test_pool == "official"
    data = config.dataset.loaded(config.seed)
    assert data.groups is not None and data.test_start is not None
    splits = partition_dataset(
        data.y, config.clients.count, config.partition, config.seed, data.groups, data.test_start
    )
    assert len(splits) == config.clients.count == 20
    for client, split in enumerate(splits):
        assert sorted(split.train.tolist()) == np.flatnonzero(data.groups == client).tolist(), client
        np.testing.assert_array_equal(split.test, np.arange(data.test_start, len(data)))
