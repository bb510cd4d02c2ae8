"""Partitioners: which samples each client holds, and each client's own train/test(/validation) split.

Every scheme returns one index array per client and is a pure function of (labels, settings, seed):
same seed, same partition. Each client's indices are then shuffled and split per client, as in
FLAME's experiments (flame.md 6.1: 80/20 per client, so test data follow the client's distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from raysim.errors import PartitionError
from raysim.seeding import Stream, rng


class _Scheme(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="per-client share held out for testing")
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of each client's training part held out for the HM-val choice"
    )


class IIDSettings(_Scheme):
    scheme: Literal["iid"] = "iid"


class DirichletSettings(_Scheme):
    """Distribution-based label skew (flame.md 6.3 scheme 2): per class k, p_k ~ Dir(beta)."""

    scheme: Literal["dirichlet"] = "dirichlet"
    beta: float = Field(0.5, gt=0.0)
    min_samples: int = Field(2, ge=2, description="redraw until every client holds at least this many")


class QLabelSettings(_Scheme):
    """Quantity-based label imbalance, "#label = q" (flame.md 6.3 scheme 1)."""

    scheme: Literal["q_label"] = "q_label"
    q: int = Field(2, ge=1, description="shards (hence at most q classes) per client")


PartitionSettings = Annotated[IIDSettings | DirichletSettings | QLabelSettings, Field(discriminator="scheme")]


@dataclass(frozen=True)
class ClientSplit:
    """The sample indices (into the whole dataset) that one client holds."""

    client_id: int
    train: np.ndarray
    test: np.ndarray
    val: np.ndarray

    @property
    def num_samples(self) -> int:
        return len(self.train) + len(self.test) + len(self.val)


def iid(labels: np.ndarray, num_clients: int, generator: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(generator.permutation(len(labels)), num_clients)


def dirichlet(
    labels: np.ndarray, num_clients: int, settings: DirichletSettings, generator: np.random.Generator
) -> list[np.ndarray]:
    """Split each class among clients in proportions p_k ~ Dir(beta * 1_m); disjoint (the paper's version)."""
    classes = np.unique(labels)
    for _attempt in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k in classes:
            members = generator.permutation(np.flatnonzero(labels == k))
            shares = generator.dirichlet(np.full(num_clients, settings.beta))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        clients = [np.concatenate(p) for p in parts]
        if min(len(c) for c in clients) >= settings.min_samples:
            return clients
    raise PartitionError(
        f"partition.beta={settings.beta}: 100 Dirichlet draws all left a client with fewer than "
        f"partition.min_samples={settings.min_samples} samples; use fewer clients, a larger beta or a lower minimum"
    )


def q_label(
    labels: np.ndarray, num_clients: int, settings: QLabelSettings, generator: np.random.Generator
) -> list[np.ndarray]:
    """Cut every class into ceil(q*m/C) shards, shuffle all shards, deal q to each client.

    As in the FLAME authors' code (flame.md 6.3): shards never span two classes, so a client holds at most
    q distinct labels (fewer if it draws two shards of one class); shards are disjoint across clients.
    """
    classes = np.unique(labels)
    shards_per_class = math.ceil(settings.q * num_clients / len(classes))
    shards: list[np.ndarray] = []
    for k in classes:
        members = generator.permutation(np.flatnonzero(labels == k))
        if len(members) < shards_per_class:
            raise PartitionError(
                f"partition.q={settings.q} with clients.count={num_clients} needs {shards_per_class} shards of "
                f"class {k}, which has only {len(members)} samples; lower clients.count or partition.q"
            )
        shards += np.array_split(members, shards_per_class)
    order = generator.permutation(len(shards))
    return [
        np.concatenate([shards[s] for s in order[c * settings.q : (c + 1) * settings.q]]) for c in range(num_clients)
    ]


def split_client(client_id: int, indices: np.ndarray, settings: _Scheme, generator: np.random.Generator) -> ClientSplit:
    """Shuffle a client's samples and split them into train / test (/ validation)."""
    shuffled = generator.permutation(indices)
    n_test = max(1, round(settings.test_fraction * len(shuffled)))
    n_val = round(settings.val_fraction * (len(shuffled) - n_test))
    if settings.val_fraction > 0:
        n_val = max(1, n_val)
    if len(shuffled) - n_test - n_val < 1:
        raise PartitionError(
            f"client {client_id} holds {len(shuffled)} samples, too few for partition.test_fraction="
            f"{settings.test_fraction} and partition.val_fraction={settings.val_fraction}"
        )
    test, val, train = np.split(shuffled, [n_test, n_test + n_val])
    return ClientSplit(client_id, np.sort(train), np.sort(test), np.sort(val))


def partition_dataset(
    labels: np.ndarray,
    num_clients: int,
    settings: IIDSettings | DirichletSettings | QLabelSettings,
    seed: int,
) -> list[ClientSplit]:
    """Assign samples to `num_clients` clients and split each client's samples into train/test/val."""
    if num_clients < 1:
        raise PartitionError(f"clients.count={num_clients}: must be at least 1")
    if num_clients * 2 > len(labels):
        raise PartitionError(
            f"clients.count={num_clients}: the dataset has {len(labels)} samples, fewer than 2 per client "
            "(each client needs at least one training and one test sample)"
        )
    generator = rng(seed, Stream.PARTITION)
    if isinstance(settings, IIDSettings):
        parts = iid(labels, num_clients, generator)
    elif isinstance(settings, DirichletSettings):
        parts = dirichlet(labels, num_clients, settings, generator)
    else:
        parts = q_label(labels, num_clients, settings, generator)
    return [
        split_client(client, indices, settings, rng(seed, Stream.PARTITION, 1, client))
        for client, indices in enumerate(parts)
    ]
