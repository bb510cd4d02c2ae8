"""`partition.draw: authors`: the FLAME authors' dealing, replayed call for call (zsk66/FLAME sampling.py).

Their `sampling.py` draws partitions from numpy's legacy global generator right after `np.random.seed(seed)`
(and before anything else draws from it), and their `update.py` splits each client's indices 80/20 with
Python's `random.shuffle` right after `random.seed(seed)`, client by client. `np.random.RandomState(seed)` and
`random.Random(seed)` are those same two streams, so making the same calls in the same order gives the same
partition: `seed: 1` is their seed 1. Index `k` is the k-th sample of the pooled dataset (train then test),
the order both raysim's loaders and theirs use.

Kept as they are in their code, because they change which samples a client holds:
- Dirichlet label skew visits the classes in the order they first appear in the pooled labels;
- a client's test part is `shuffled[int(0.8 n) + 1:]`: one sample of every client is in neither part;
- quantity and hybrid skew draw every client from the whole dataset (overlapping shares).
"""

from __future__ import annotations

import math
import random

import numpy as np

from raysim.errors import PartitionError


def iid(num_samples: int, num_clients: int, state: np.random.RandomState) -> list[list[int]]:
    """`mnist_iid`: int(N/m) samples per client without replacement, as sets (their iteration order is kept,
    since the per-client split shuffles that order)."""
    per_client = int(num_samples / num_clients)
    remaining = list(range(num_samples))
    parts = []
    for _ in range(num_clients):
        chosen = set(state.choice(remaining, per_client, replace=False))
        remaining = list(set(remaining) - chosen)
        parts.append(list(chosen))
    return parts


def q_label(labels: np.ndarray, num_clients: int, q: int, state: np.random.RandomState) -> list[np.ndarray]:
    """`q_label_skew`: every class cut into ceil(q m / C) shards in index order; per client, the whole shard
    list is shuffled and the client takes the first q shards."""
    num_labels = len(np.unique(labels))
    num_shards = math.ceil(q * num_clients / num_labels)
    shards: list[np.ndarray] = []
    for k in range(num_labels):
        shards.extend(np.array_split(np.where(labels == k)[0], num_shards))
    parts = []
    for _ in range(num_clients):
        if len(shards) < q:
            raise PartitionError(
                f"partition.draw=authors: {num_clients} q-label clients with partition.q={q} need {q * num_clients} "
                f"shards, the authors' dealing cut {num_labels * num_shards}; lower clients.count or partition.q"
            )
        state.shuffle(shards)
        parts.append(np.concatenate(shards[:q]))
        del shards[:q]
    return parts


def dirichlet(labels: np.ndarray, num_clients: int, beta: float, state: np.random.RandomState) -> list[np.ndarray]:
    """`dir_label_skew`: per class (in order of first appearance) p ~ Dir(beta); client i draws int(p_i n_k)
    of that class's samples without replacement, independently of the other clients."""
    first_seen = sorted(np.unique(labels), key=lambda k: int(np.argmax(labels == k)))
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for k in first_seen:
        members = list(np.flatnonzero(labels == k))
        shares = state.dirichlet(np.ones(num_clients) * beta)
        for client, share in enumerate(shares):
            parts[client].extend(state.choice(members, size=int(share * len(members)), replace=False))
    return [np.array(p, dtype=np.int64) for p in parts]


def quantity(
    num_samples: int, num_clients: int, beta: float, min_samples: int, state: np.random.RandomState
) -> list[np.ndarray]:
    """`dir_quantity_skew`: p ~ Dir(beta) over clients; client i draws max(100, int(p_i N)) samples of the
    whole dataset without replacement, independently of the others."""
    shares = state.dirichlet(np.ones(num_clients) * beta)
    sizes = [max(min_samples, int(share * num_samples)) for share in shares]
    return [state.choice(num_samples, size=size, replace=False) for size in sizes]


def hybrid(
    labels: np.ndarray, num_clients: int, q: int, beta: float, min_samples: int, state: np.random.RandomState
) -> list[np.ndarray]:
    """`hybrid_skew`: ceil(m/2) q-label clients, then floor(m/2) quantity-skew clients, both over the whole
    dataset, from the one stream in that order."""
    parts = q_label(labels, math.ceil(num_clients / 2), q, state)
    if num_clients // 2:
        parts += quantity(len(labels), num_clients // 2, beta, min_samples, state)
    return parts


def contiguous(num_samples: int, num_clients: int) -> list[np.ndarray]:
    """`noise_feature_skew`: client i holds the i-th block of N // m consecutive samples (no randomness)."""
    per_client = num_samples // num_clients
    return [np.arange(c * per_client, (c + 1) * per_client) for c in range(num_clients)]


def split(parts: list, train_share: float, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`train_val_test`: per client in order, `random.shuffle` its index list, then train = the first
    int(0.8 n), test = the rest after skipping one."""
    stream = random.Random(seed)
    splits = []
    for indices in parts:
        order = [int(i) for i in indices]
        stream.shuffle(order)
        train_size = int(train_share * len(order))
        splits.append((np.array(order[:train_size], dtype=np.int64), np.array(order[train_size + 1 :], dtype=np.int64)))
    return splits
