"""`partition.draw: authors` and `partition.layout: contiguous`: the FLAME authors' dealing, seed for seed.

The reference below is written the way their `sampling.py` and `update.py` are (module-level `np.random` after
`np.random.seed(seed)`, `random.shuffle` after `random.seed(seed)`, their dict/set/list structures), on the
real pooled Fashion-MNIST labels, and compared with raysim's replay client by client.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.data.fashion_mnist import load_fashion_mnist
from raysim.data.partitions import (
    DirichletSettings,
    HybridSettings,
    IIDSettings,
    QLabelSettings,
    QualitySettings,
    QuantitySettings,
    authors_attackers,
    partition_dataset,
)
from raysim.errors import ConfigError
from tests.support.authors import their_q_label

# --- the reference: the authors' calls, in their order and with their data structures -------------------


def _their_iid(n, num_users):
    num_items = int(n / num_users)
    dict_users, all_idxs = {}, [i for i in range(n)]
    for i in range(num_users):
        dict_users[i] = set(np.random.choice(all_idxs, num_items, replace=False))
        all_idxs = list(set(all_idxs) - dict_users[i])
    return dict_users


def _their_dir_label(labels, num_users):
    beta = 0.5
    label_to_indices = defaultdict(list)
    for idx, label in enumerate(labels):
        label_to_indices[label].append(idx)
    user_groups = defaultdict(list)
    for _label, indices in label_to_indices.items():
        label_distribution = np.random.dirichlet(np.ones(num_users) * beta)
        for i, client_probs in enumerate(label_distribution):
            user_groups[i].extend(np.random.choice(indices, size=int(client_probs * len(indices)), replace=False))
    return {client: np.array(indices) for client, indices in user_groups.items()}


def _their_dir_quantity(n, num_users):
    probabilities = np.random.dirichlet(np.ones(num_users) * 0.5)
    return [np.random.choice(n, size=max(100, int(probabilities[i] * n)), replace=False) for i in range(num_users)]


def _their_hybrid(labels, num_users, q):
    label_part = list(their_q_label(labels, math.ceil(num_users / 2), q).values())
    return label_part + _their_dir_quantity(len(labels), math.floor(num_users / 2))


def _their_quality(n, num_users):
    data_per_user = n // num_users
    return [list(range(i * data_per_user, min((i + 1) * data_per_user, n))) for i in range(num_users)]


def _their_splits(user_groups, num_users):
    """update.py's train_val_test, client by client as PerLocalUpdate objects are built (in their shuffled order)."""
    out = []
    for idx in range(num_users):
        idxs = list(user_groups[idx])
        train_size = int(0.8 * len(idxs))
        random.shuffle(idxs)
        out.append(([int(i) for i in idxs[:train_size]], [int(i) for i in idxs[train_size + 1 :]]))
    return out


def _theirs(scheme: str, labels: np.ndarray, seed: int, num_users: int, q: int = 2):
    np.random.seed(seed)  # setup_seed(seed), then get_dataset(args)
    random.seed(seed)
    deal = {
        "iid": lambda: _their_iid(len(labels), num_users),
        "q_label": lambda: their_q_label(labels, num_users, q),
        "dirichlet": lambda: _their_dir_label(labels, num_users),
        "quantity": lambda: _their_dir_quantity(len(labels), num_users),
        "hybrid": lambda: _their_hybrid(labels, num_users, q),
        "quality": lambda: _their_quality(len(labels), num_users),
    }[scheme]()
    return _their_splits(deal, num_users)


SETTINGS = {
    "iid": IIDSettings(draw="authors"),
    "q_label": QLabelSettings(q=2, draw="authors"),
    "dirichlet": DirichletSettings(overlap=True, draw="authors"),
    "quantity": QuantitySettings(overlap=True, draw="authors"),
    "hybrid": HybridSettings(q=2, overlap=True, draw="authors"),
    "quality": QualitySettings(layout="contiguous", noise_scale="std", draw="authors"),
}


@pytest.mark.parametrize("scheme", sorted(SETTINGS))
@pytest.mark.parametrize("seed", [1, 10, 10000])
def test_authors_draw_deals_what_their_code_deals_for_their_seeds(labels, scheme, seed):
    ours = partition_dataset(labels, 10, SETTINGS[scheme], seed)
    theirs = _theirs(scheme, labels, seed, 10)
    for client, (train, test) in zip(ours, theirs, strict=True):
        assert client.train.tolist() == train
        assert client.test.tolist() == test
        assert len(client.val) == 0
    counts = [np.bincount(labels[c.train], minlength=10).tolist() for c in ours]
    assert counts == [np.bincount(labels[t], minlength=10).tolist() for t, _ in theirs]


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return load_fashion_mnist()[1]


def test_authors_q_label_with_q_above_the_shards_per_class_matches_too(labels):
    """q = 3, m = 10: three shards per class, so a client may draw two shards of one class (#label <= q)."""
    ours = partition_dataset(labels, 10, QLabelSettings(q=3, draw="authors"), 100)
    theirs = _theirs("q_label", labels, 100, 10, q=3)
    assert [c.train.tolist() for c in ours] == [t for t, _ in theirs]


def test_authors_draw_differs_between_seeds_and_from_raysims_streams(labels):
    one = partition_dataset(labels, 10, QLabelSettings(q=2, draw="authors"), 1)
    ten = partition_dataset(labels, 10, QLabelSettings(q=2, draw="authors"), 10)
    ours = partition_dataset(labels, 10, QLabelSettings(q=2), 1)
    classes = [sorted(set(labels[c.train].tolist())) for c in one]
    assert classes != [sorted(set(labels[c.train].tolist())) for c in ten]
    assert [c.train.tolist() for c in one] != [c.train.tolist() for c in ours]


def test_authors_split_leaves_one_sample_of_each_client_out_as_their_code_does(labels):
    """Client i of the contiguous layout holds exactly the i-th block; 80 % train, the rest minus one test."""
    clients = partition_dataset(labels, 10, SETTINGS["quality"], 1)
    for i, client in enumerate(clients):
        block = set(range(i * 7000, (i + 1) * 7000))
        assert set(client.train.tolist()) | set(client.test.tolist()) < block
        assert (len(client.train), len(client.test)) == (5600, 1399)


def test_contiguous_layout_on_a_hand_computed_case():
    """N = 10, m = 3: blocks of 10 // 3 = 3 samples, sample 9 unused, the same for every seed; the split
    into train/test is still raysim's seeded one (draw: raysim)."""
    labels = np.zeros(10, dtype=np.int64)
    settings = QualitySettings(layout="contiguous", test_fraction=0.34)
    for seed in (0, 7):
        clients = partition_dataset(labels, 3, settings, seed)
        held = [sorted(c.train.tolist() + c.test.tolist()) for c in clients]
        assert held == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        assert [len(c.test) for c in clients] == [1, 1, 1]
    shuffled = partition_dataset(labels, 3, QualitySettings(test_fraction=0.34), 0)
    assert sorted(len(c.train) + len(c.test) for c in shuffled) == [3, 3, 4]  # IID blocks use every sample


def test_noise_scale_of_the_contiguous_layout_is_per_client_as_configured():
    labels = np.zeros(100, dtype=np.int64)
    clients = partition_dataset(labels, 4, QualitySettings(layout="contiguous", sigma=0.1, noise_scale="std"), 0)
    assert [c.noise_std for c in clients] == pytest.approx([0.0, 0.025, 0.05, 0.075], abs=1e-15)


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        ({"scheme": "dirichlet", "draw": "authors"}, "set partition.overlap: true"),
        ({"scheme": "quantity", "draw": "authors", "overlap": False}, "set partition.overlap: true"),
        ({"scheme": "quality", "draw": "authors"}, "set partition.layout: contiguous"),
        ({"scheme": "q_label", "draw": "authors", "val_fraction": 0.1}, "partition.val_fraction=0.1"),
        ({"scheme": "q_label", "draw": "theirs"}, "partition.draw: must be 'raysim' or 'authors'"),
        ({"scheme": "quality", "layout": "blocks"}, "partition.layout: must be 'shuffled' or 'contiguous'"),
        ({"scheme": "mixed", "draw": "authors"}, "partition.draw: unknown key"),
    ],
)
def test_authors_draw_refuses_settings_it_cannot_replay_in_one_line(partition, message):
    with pytest.raises(ConfigError) as error:
        validate_config({"algorithm": {"name": "flame"}, "partition": partition})
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("seed", [1, 100])
def test_authors_draw_picks_the_attackers_their_main_draws_next(labels, seed):
    """main.py: right after get_dataset, `np.random.choice(range(m), max(int(frac m), 1), replace=False)`."""
    np.random.seed(seed)
    _their_hybrid(labels, 50, 2)
    theirs = np.random.choice(range(50), max(int(0.2 * 50), 1), replace=False)
    ours = authors_attackers(SETTINGS["hybrid"], labels, 50, seed, 10)
    assert ours == frozenset(int(c) for c in theirs)
    assert authors_attackers(HybridSettings(q=2, overlap=True), labels, 50, seed, 10) is None
