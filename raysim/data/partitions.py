"""Partitioners: which samples each client holds, and each client's own train/test(/validation) split.

Every scheme returns one index array per client and is a pure function of (labels, settings, seed):
same seed, same partition. Each client's indices are then shuffled and split per client, as in
FLAME's experiments (the authors' code: 80/20 per client, so test data follow the client's distribution).

The schemes are FLAME's six (FLAME, Sec. VI-A) plus IID, a mixed IID/Dirichlet split and FedSLR's per-client
label prior with its own per-client test sets (FedSLR, App. B.1). The paper's
versions are disjoint (every sample goes to at most one client); where the authors' code draws each
client's samples independently from the whole dataset (Dirichlet label skew, quantity skew, hybrid),
`overlap: true` reproduces that instead. All checks run here, in the driver, before any Ray work.
"""

from __future__ import annotations

import bisect
import math
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

import raysim.data.authors_draw as authors_draw
from raysim.data.scheme import PARTITIONS, ClientSplit, SchemeSettings, matched_test, test_and_train_pools
from raysim.errors import PartitionError
from raysim.examples import ExampleContext, Fragment
from raysim.seeding import Stream, rng


class _FlameScheme(SchemeSettings):
    """A scheme of FLAME's code, which `draw: authors` replays with the authors' own random calls."""

    draw: Literal["raysim", "authors"] = Field(
        "raysim",
        description="raysim: seeded streams; authors: the FLAME authors' sampling.py calls on np.random.seed(seed) "
        "and their per-client random.shuffle 80/20 split, so seed N deals what their seed N deals",
    )

    @model_validator(mode="after")
    def _check_authors_draw(self):
        if self.draw != "authors":
            return self
        if self.test_split != "client":
            raise ValueError(
                f"partition.test_split={self.test_split}: partition.draw=authors replays the authors' per-client 80/20 "
                "split; use test_split client or draw raysim"
            )
        if self.val_fraction:
            raise ValueError(
                f"partition.val_fraction={self.val_fraction}: partition.draw=authors splits each client into train "
                "and test only, as the authors' code does; use val_fraction 0 or draw raysim"
            )
        if getattr(self, "overlap", True) is False:
            raise ValueError(
                f"partition.draw=authors replays the authors' {self.scheme} dealing, whose client shares overlap; "
                "set partition.overlap: true (or use draw: raysim for the disjoint version)"
            )
        if getattr(self, "layout", "contiguous") != "contiguous":
            raise ValueError(
                "partition.draw=authors replays the authors' quality skew, which deals contiguous blocks; set "
                "partition.layout: contiguous (or use draw: raysim)"
            )
        return self

    def authors_assign(
        self, labels: np.ndarray, num_clients: int, state: np.random.RandomState, groups: np.ndarray | None
    ) -> list:
        """The authors' dealing of this scheme (authors_draw), from their legacy generator."""
        return authors_draw.iid(len(labels), num_clients, state)

    def splits(self, labels, num_clients, seed, groups, test_start=None):
        if self.draw != "authors":
            return super().splits(labels, num_clients, seed, groups, test_start)
        parts = self.authors_assign(np.asarray(labels), num_clients, np.random.RandomState(seed), groups)
        pairs = authors_draw.split(parts, 1.0 - self.test_fraction, seed)
        return self.with_noise([split_or_refuse(c, train, test) for c, (train, test) in enumerate(pairs)], num_clients)


@PARTITIONS.register()
class IIDSettings(_FlameScheme):
    """Uniformly shuffled, equal-size (+-1) disjoint shares; or with `samples_per_client` each client's own uniform
    draw, so that more clients than samples share the data set (cross-device scale, issue 49)."""

    scheme: Literal["iid"] = "iid"
    samples_per_client: int | None = Field(
        None,
        ge=2,
        description="each client draws this many samples without replacement from the whole data set, independently "
        "of the others (clients share samples: 100,000 clients on Fashion-MNIST's 70,000 images); None: disjoint "
        "equal shares",
    )

    @model_validator(mode="after")
    def _check_samples_per_client(self):
        if self.samples_per_client is not None and self.draw == "authors":
            raise ValueError(
                f"partition.samples_per_client={self.samples_per_client}: partition.draw=authors replays the authors' "
                "disjoint shares; leave samples_per_client out or use draw raysim"
            )
        return self

    def assign(self, labels, num_clients, generator, groups):
        if self.samples_per_client is not None:
            return shared_iid(len(labels), num_clients, self.samples_per_client, generator)
        return iid(labels, num_clients, generator)


@PARTITIONS.register()
class DirichletSettings(_FlameScheme):
    """Distribution-based label skew (FLAME, Sec. VI-A): per class k, p_k ~ Dir(beta)."""

    scheme: Literal["dirichlet"] = "dirichlet"
    by_label: ClassVar[bool] = True
    beta: float = Field(0.5, gt=0.0, description="Dirichlet concentration: small is skewed, large near IID")
    min_samples: int = Field(2, ge=2, description="redraw until every client holds at least this many")
    overlap: bool = Field(
        False, description="draw each client's class-k share independently from all of class k (authors' code)"
    )

    def assign(self, labels, num_clients, generator, groups):
        return dirichlet(labels, num_clients, self, generator)

    def authors_assign(self, labels, num_clients, state, groups):
        return authors_draw.dirichlet(labels, num_clients, self.beta, state)


@PARTITIONS.register()
class QLabelSettings(_FlameScheme):
    """Quantity-based label imbalance, "#label = q" (FLAME, Sec. VI-A)."""

    scheme: Literal["q_label"] = "q_label"
    by_label: ClassVar[bool] = True
    q: int = Field(2, ge=1, description="shards (hence at most q classes) per client")

    def assign(self, labels, num_clients, generator, groups):
        return q_label(labels, num_clients, self.q, generator)

    def authors_assign(self, labels, num_clients, state, groups):
        return authors_draw.q_label(labels, num_clients, self.q, state)


@PARTITIONS.register()
class QualitySettings(_FlameScheme):
    """Noise-based quality skew "Gau(sigma)" (FLAME, Sec. VI-A): equal blocks, client i's features get
    N(0, s_i) noise at every access, with s_i = sigma * i / m as the variance (paper) or the std (authors' code).

    The blocks are shuffled IID shares (paper) or, `layout: contiguous` (the authors' code), the i-th run
    of N // m consecutive samples of the pooled dataset, the same for every seed."""

    scheme: Literal["quality"] = "quality"
    sigma: float = Field(0.1, ge=0.0, description="noise level: client i of m gets s_i = sigma * i / m")
    noise_scale: Literal["variance", "std"] = Field(
        "variance", description="sigma*i/m is the noise variance (paper) or its std (authors' code)"
    )

    layout: Literal["shuffled", "contiguous"] = Field(
        "shuffled", description="shuffled IID blocks (paper) or contiguous blocks of the pooled data (authors' code)"
    )

    def noise_std(self, client: int, num_clients: int) -> float:
        scale = self.sigma * client / num_clients
        return math.sqrt(scale) if self.noise_scale == "variance" else scale

    def assign(self, labels, num_clients, generator, groups):
        if self.layout == "contiguous":
            return authors_draw.contiguous(len(labels), num_clients)
        return iid(labels, num_clients, generator)

    def authors_assign(self, labels, num_clients, state, groups):
        return authors_draw.contiguous(len(labels), num_clients)


@PARTITIONS.register()
class QuantitySettings(_FlameScheme):
    """Quantity skew "Dir(beta)" (FLAME, Sec. VI-A): p ~ Dir(beta) over clients, client i gets a p_i share.

    Disjoint (paper): every client first gets `min_samples`, the rest is cut in Dir(beta) proportions.
    `overlap` (authors' code): client i draws max(min_samples, int(p_i N)) samples from the whole dataset."""

    scheme: Literal["quantity"] = "quantity"
    beta: float = Field(0.5, gt=0.0, description="Dirichlet concentration of the clients' shares: small is skewed")
    min_samples: int = Field(100, ge=2, description="samples every client holds at least (100 in the authors' code)")
    overlap: bool = Field(False, description="draw each client's samples independently (authors' code)")

    def assign(self, labels, num_clients, generator, groups):
        return quantity(np.arange(len(labels)), num_clients, self.beta, self.min_samples, self.overlap, generator)

    def authors_assign(self, labels, num_clients, state, groups):
        return authors_draw.quantity(len(labels), num_clients, self.beta, self.min_samples, state)


@PARTITIONS.register()
class NaturalSettings(_FlameScheme):
    """Feature skew by a natural id (FLAME, Sec. VI-A, FEMNIST writers): the dataset's group ids, sorted,
    are dealt contiguously, (number of groups) // m per client; leftover groups are not used, as in the code.

    `id_offsets` deals them as FedAPM's KU-HAR code does instead (FedAPM, Table 2, App. B.1): client i holds the ids at
    sorted positions i + o for each offset o, [0, 19, 39, 59] there. Such clients may share an id (there client 0 and
    client 19 both hold position 19), as in that code."""

    scheme: Literal["natural"] = "natural"
    id_offsets: list[int] | None = Field(
        None,
        description="client i holds the sorted group ids at positions i + offset for each offset (FedAPM's KU-HAR: "
        "[0, 19, 39, 59]); default: contiguous runs of groups // m ids",
    )

    @model_validator(mode="after")
    def _check_offsets(self):
        if self.id_offsets is not None and (not self.id_offsets or min(self.id_offsets) < 0):
            raise ValueError(f"partition.id_offsets={self.id_offsets}: give one or more offsets, each 0 or more")
        return self

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """Natural ids need a dataset that has them: the synthetic writers (FEMNIST-like, always available)."""
        return {"partition": {"scheme": "natural"}, "dataset": {"name": "synthetic_writers"}}

    def assign(self, labels, num_clients, generator, groups):
        return natural(groups, num_clients, self.id_offsets)

    def authors_assign(self, labels, num_clients, state, groups):
        return natural(groups, num_clients, self.id_offsets)


@PARTITIONS.register()
class HybridSettings(_FlameScheme):
    """Hybrid skew (FLAME, Sec. VI-A): ceil(m/2) clients get q-label shards, floor(m/2) quantity skew.

    Disjoint (paper): the samples are first split at random between the two groups in proportion to their
    client counts. `overlap` (authors' code): both groups draw from the whole dataset independently."""

    scheme: Literal["hybrid"] = "hybrid"
    by_label: ClassVar[bool] = True
    q: int = Field(2, ge=1, description="shards (hence at most q classes) per client of the label-skew half")
    beta: float = Field(0.5, gt=0.0, description="Dirichlet concentration of the quantity-skew half's shares")
    min_samples: int = Field(100, ge=2, description="samples every quantity-skew client holds at least")
    overlap: bool = Field(False, description="both halves draw from the whole dataset (authors' code)")

    def assign(self, labels, num_clients, generator, groups):
        return hybrid(labels, num_clients, self, generator)

    def authors_assign(self, labels, num_clients, state, groups):
        return authors_draw.hybrid(labels, num_clients, self.q, self.beta, self.min_samples, state)


@PARTITIONS.register()
class MixedSettings(SchemeSettings):
    """A share `iid_fraction` of the samples is dealt IID, the rest by Dirichlet(beta) label skew (disjoint):
    interpolates between IID (1) and pure label skew (0)."""

    scheme: Literal["mixed"] = "mixed"
    by_label: ClassVar[bool] = True
    iid_fraction: float = Field(0.5, ge=0.0, le=1.0, description="share dealt IID (1: IID, 0: pure label skew)")
    beta: float = Field(0.5, gt=0.0, description="Dirichlet concentration of the label-skewed rest")
    min_samples: int = Field(2, ge=2, description="redraw until every client holds at least this many")

    def assign(self, labels, num_clients, generator, groups):
        return mixed(labels, num_clients, self, generator)


@PARTITIONS.register()
class LabelPriorSettings(SchemeSettings):
    """FedSLR's split (FedSLR, App. B.1): per-client class prior ~ Dir(alpha 1_C), balanced sizes N/M, samples dealt
    one at a time to a random non-full client with the class drawn from its prior; a `test_samples` test set
    per client with its training label proportions, drawn from a held-out pool that no client trains on, or with
    `test_pool: official` from the dataset's own test set while the clients share its training set (the paper's
    500 CIFAR samples a client).

    Paper default: no sample repeats (an exhausted class is dropped from the client's prior, renormalized).
    `refill: true` is the authors' code: an exhausted class pool is refilled, so samples can repeat."""

    scheme: Literal["label_prior"] = "label_prior"
    by_label: ClassVar[bool] = True
    alpha: float = Field(0.1, gt=0.0, description="concentration of each client's class prior Dir(alpha 1_C)")
    refill: bool = Field(False, description="refill an exhausted class pool, samples may repeat (authors' code)")
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of the dataset held out as the test pool that no client trains on"
    )

    global_test: ClassVar[bool] = False
    own_test_pool: ClassVar[bool] = True

    def splits(self, labels, num_clients, seed, groups, test_start=None):  # draws its own per-client test sets
        return label_prior(labels, num_clients, self, rng(seed, Stream.PARTITION), test_start)


def iid(labels: np.ndarray, num_clients: int, generator: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(generator.permutation(len(labels)), num_clients)


def shared_iid(num_samples: int, num_clients: int, per_client: int, generator: np.random.Generator) -> list[np.ndarray]:
    """`per_client` distinct samples for each client, drawn uniformly and independently of the other clients."""
    if per_client > num_samples:
        raise PartitionError(
            f"partition.samples_per_client={per_client} exceeds the {num_samples} samples to draw from"
        )
    return [generator.choice(num_samples, per_client, replace=False) for _ in range(num_clients)]


def _dirichlet_disjoint(
    labels: np.ndarray, pool: np.ndarray, num_clients: int, beta: float, min_samples: int, generator
) -> list[np.ndarray]:
    """Split each class of `pool` among clients in Dir(beta) proportions; redraw until all hold min_samples."""
    classes = np.unique(labels[pool])
    for _attempt in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k in classes:
            members = generator.permutation(pool[labels[pool] == k])
            shares = generator.dirichlet(np.full(num_clients, beta))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        clients = [np.concatenate(p) for p in parts]
        if min(len(c) for c in clients) >= min_samples:
            return clients
    raise PartitionError(
        f"partition.beta={beta}: 100 Dirichlet draws all left a client with fewer than "
        f"partition.min_samples={min_samples} samples; use fewer clients, a larger beta or a lower minimum"
    )


def dirichlet(
    labels: np.ndarray, num_clients: int, settings: DirichletSettings, generator: np.random.Generator
) -> list[np.ndarray]:
    """Label skew, disjoint (paper) or with each client's class-k draw independent (authors' code, overlapping)."""
    if not settings.overlap:
        return _dirichlet_disjoint(
            labels, np.arange(len(labels)), num_clients, settings.beta, settings.min_samples, generator
        )
    classes = np.unique(labels)
    shares = generator.dirichlet(np.full(num_clients, settings.beta), size=len(classes))  # (C, m)
    parts = []
    for client in range(num_clients):
        chunks = []
        for k_index, k in enumerate(classes):
            members = np.flatnonzero(labels == k)
            take = int(shares[k_index, client] * len(members))
            chunks.append(generator.choice(members, take, replace=False))
        parts.append(np.concatenate(chunks))
    if min(len(p) for p in parts) < settings.min_samples:
        raise PartitionError(
            f"partition.beta={settings.beta} with partition.overlap=true left a client with fewer than "
            f"partition.min_samples={settings.min_samples} samples; use fewer clients or a larger beta"
        )
    return parts


def q_label(
    labels: np.ndarray, num_clients: int, q: int, generator: np.random.Generator, pool: np.ndarray | None = None
) -> list[np.ndarray]:
    """Cut every class into ceil(q*m/C) shards, shuffle all shards, deal q to each client.

    As in the FLAME authors' code: shards never span two classes, so a client holds at most
    q distinct labels (fewer if it draws two shards of one class); shards are disjoint across clients.
    """
    pool = np.arange(len(labels)) if pool is None else pool
    classes = np.unique(labels[pool])
    shards_per_class = math.ceil(q * num_clients / len(classes))
    shards: list[np.ndarray] = []
    for k in classes:
        members = generator.permutation(pool[labels[pool] == k])
        if len(members) < shards_per_class:
            raise PartitionError(
                f"partition.q={q} with {num_clients} q-label clients needs {shards_per_class} shards of "
                f"class {k}, which has only {len(members)} samples; lower clients.count or partition.q"
            )
        shards += np.array_split(members, shards_per_class)
    order = generator.permutation(len(shards))
    return [np.concatenate([shards[s] for s in order[c * q : (c + 1) * q]]) for c in range(num_clients)]


def quantity(
    pool: np.ndarray, num_clients: int, beta: float, min_samples: int, overlap: bool, generator: np.random.Generator
) -> list[np.ndarray]:
    """Quantity skew over the samples `pool` (see QuantitySettings)."""
    shares = generator.dirichlet(np.full(num_clients, beta))
    if overlap:
        if min_samples > len(pool):
            raise PartitionError(
                f"partition.min_samples={min_samples} exceeds the {len(pool)} samples available to quantity skew"
            )
        sizes = np.maximum(min_samples, (shares * len(pool)).astype(int))
        return [generator.choice(pool, size, replace=False) for size in sizes]
    spare = len(pool) - num_clients * min_samples
    if spare < 0:
        raise PartitionError(
            f"partition.min_samples={min_samples} for {num_clients} quantity-skew clients needs "
            f"{num_clients * min_samples} samples but only {len(pool)} are available; lower clients.count or "
            "partition.min_samples"
        )
    sizes = min_samples + np.floor(shares * spare).astype(int)
    sizes[: spare - (sizes.sum() - num_clients * min_samples)] += 1  # hand out the rounding remainder
    return np.split(generator.permutation(pool), np.cumsum(sizes)[:-1])


def natural(groups: np.ndarray | None, num_clients: int, offsets: list[int] | None = None) -> list[np.ndarray]:
    """Contiguous runs of (number of groups) // m sorted group ids per client (FLAME, Sec. VI-A), or with
    `offsets` the sorted ids at positions i + o for client i (see NaturalSettings)."""
    if groups is None:
        raise PartitionError("partition.scheme=natural needs a dataset with a group id column (e.g. writer ids)")
    ids = np.unique(groups)
    if offsets is not None:
        needed = num_clients + max(offsets)
        if needed > len(ids):
            raise PartitionError(
                f"partition.id_offsets={offsets} with clients.count={num_clients} needs {needed} group ids; the "
                f"dataset has {len(ids)}"
            )
        return [np.flatnonzero(np.isin(groups, ids[[c + o for o in offsets]])) for c in range(num_clients)]
    per_client = len(ids) // num_clients
    if per_client < 1:
        raise PartitionError(
            f"partition.scheme=natural: the dataset has {len(ids)} groups, fewer than clients.count={num_clients}"
        )
    return [np.flatnonzero(np.isin(groups, ids[c * per_client : (c + 1) * per_client])) for c in range(num_clients)]


def hybrid(
    labels: np.ndarray, num_clients: int, settings: HybridSettings, generator: np.random.Generator
) -> list[np.ndarray]:
    """ceil(m/2) q-label clients, then floor(m/2) quantity-skew clients (see HybridSettings)."""
    label_clients = math.ceil(num_clients / 2)
    quantity_clients = num_clients - label_clients
    everything = np.arange(len(labels))
    if settings.overlap or quantity_clients == 0:
        label_pool, quantity_pool = everything, everything
    else:
        shuffled = generator.permutation(everything)
        cut = round(len(labels) * label_clients / num_clients)
        label_pool, quantity_pool = np.sort(shuffled[:cut]), np.sort(shuffled[cut:])
    parts = q_label(labels, label_clients, settings.q, generator, label_pool)
    if quantity_clients:
        parts += quantity(
            quantity_pool, quantity_clients, settings.beta, settings.min_samples, settings.overlap, generator
        )
    return parts


def mixed(labels: np.ndarray, num_clients: int, settings: MixedSettings, generator) -> list[np.ndarray]:
    """An IID share plus a Dirichlet label-skew share of the remaining samples, per client (disjoint)."""
    shuffled = generator.permutation(len(labels))
    cut = round(settings.iid_fraction * len(labels))
    iid_parts = np.array_split(shuffled[:cut], num_clients)
    rest = np.sort(shuffled[cut:])
    if len(rest) == 0:
        return iid_parts
    skewed = _dirichlet_disjoint(labels, rest, num_clients, settings.beta, 0, generator)
    parts = [np.concatenate([a, b]) for a, b in zip(iid_parts, skewed, strict=True)]
    if min(len(p) for p in parts) < settings.min_samples:
        raise PartitionError(
            f"partition.iid_fraction={settings.iid_fraction}, partition.beta={settings.beta}: a client holds fewer "
            f"than partition.min_samples={settings.min_samples} samples; use fewer clients or a larger iid_fraction"
        )
    return parts


def _deal_by_prior(
    labels: np.ndarray, pool: np.ndarray, num_clients: int, settings: LabelPriorSettings, generator
) -> list[np.ndarray]:
    """The training draw of `label_prior`: every client gets len(pool) // m samples (+1 for the first
    len(pool) % m), one sample at a time to a uniformly random non-full client."""
    classes = np.unique(labels[pool])
    priors = generator.dirichlet(np.full(len(classes), settings.alpha), size=num_clients)
    cumulative = [list(np.cumsum(p)) for p in priors]
    members = [pool[labels[pool] == k] for k in classes]  # `pool` is shuffled, so each class pool is too
    left = [len(m) for m in members]
    sizes = np.full(num_clients, len(pool) // num_clients) + (np.arange(num_clients) < len(pool) % num_clients)
    capacity = sizes.tolist()
    open_clients = list(range(num_clients))
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    draws = generator.random((2, int(sizes.sum()))).tolist()
    last = len(classes) - 1
    for u_client, u_class in zip(*draws, strict=True):
        position = int(u_client * len(open_clients))
        client = open_clients[position]
        capacity[client] -= 1
        if capacity[client] == 0:  # swap-remove a full client
            open_clients[position] = open_clients[-1]
            open_clients.pop()
        k = min(bisect.bisect_left(cumulative[client], u_class), last)
        if settings.refill:
            while left[k] == 0:  # the authors' code: refill the class pool, then draw the class again
                left[k] = len(members[k])
                k = min(bisect.bisect_left(cumulative[client], generator.random()), last)
        elif left[k] == 0:  # the prior restricted to the classes left, renormalized
            weights = priors[client] * (np.array(left) > 0)
            total = weights.sum()
            if total > 0:
                k = min(int(np.searchsorted(np.cumsum(weights), generator.random() * total)), last)
            else:  # the prior puts no mass on any class left: uniform over them
                k = int(generator.choice(np.flatnonzero(np.array(left) > 0)))
            while left[k] == 0:  # float rounding at a boundary
                k = (k + 1) % len(classes)
        left[k] -= 1
        parts[client].append(int(members[k][left[k]]))
    return [np.array(p, dtype=np.int64) for p in parts]


def label_prior(
    labels: np.ndarray,
    num_clients: int,
    settings: LabelPriorSettings,
    generator: np.random.Generator,
    test_start: int | None = None,
) -> list[ClientSplit]:
    """FedSLR's split (see LabelPriorSettings); returns every client's train / test / val indices."""
    labels = np.asarray(labels)
    if settings.test_pool == "official":
        test_pool, official = test_and_train_pools(settings, len(labels), num_clients, 0, test_start)
        train_pool = generator.permutation(official)  # shuffled, as the class pools are drawn from its end
        held = len(test_pool)
    else:
        order = generator.permutation(len(labels))
        held = round(settings.test_fraction * len(labels))
        test_pool, train_pool = order[:held], order[held:]
    if held == 0 or len(train_pool) < num_clients:
        raise PartitionError(
            f"partition.test_fraction={settings.test_fraction} holds out {held} of {len(labels)} samples, leaving "
            f"{len(train_pool)} to train on for clients.count={num_clients}; both parts must be non-empty and the "
            "training part hold one sample per client"
        )
    parts = _deal_by_prior(labels, train_pool, num_clients, settings, generator)
    splits = []
    for client, drawn in enumerate(parts):
        test = matched_test(settings, labels, drawn, test_pool, generator, client)
        shuffled = generator.permutation(drawn)
        n_val = max(1, round(settings.val_fraction * len(shuffled))) if settings.val_fraction > 0 else 0
        if len(shuffled) - n_val < 1:
            raise PartitionError(
                f"client {client} holds {len(shuffled)} training samples, too few for partition.val_fraction="
                f"{settings.val_fraction}"
            )
        val, train = np.split(shuffled, [n_val])
        splits.append(ClientSplit(client, np.sort(train), test, np.sort(val)))
    return splits


def check_classes(settings: SchemeSettings, labels: np.ndarray) -> None:
    """Refuse `partition.q` above the dataset's number of classes, in the driver before any Ray or MLflow work:
    the shards could still be dealt, but a client could then hold every class, not the label skew asked for."""
    labels = np.asarray(labels)
    if not isinstance(settings, QLabelSettings | HybridSettings) or not np.issubdtype(labels.dtype, np.integer):
        return  # a regression target is refused by partition_dataset, naming the scheme
    num_classes = len(np.unique(labels))
    if settings.q > num_classes:
        raise PartitionError(
            f"partition.q={settings.q}: the dataset has {num_classes} classes, so a client cannot hold "
            f"{settings.q} of them; partition.q is at most {num_classes}"
        )


def partition_dataset(
    labels: np.ndarray,
    num_clients: int,
    settings: SchemeSettings,
    seed: int,
    groups: np.ndarray | None = None,
    test_start: int | None = None,
) -> list[ClientSplit]:
    """Assign samples to `num_clients` clients and split each client's samples into train/test/val (the scheme's
    `splits`), after the checks every scheme shares.

    `groups` holds a natural id per sample (writer, speaker), needed only by the `natural` scheme; `test_start`
    where the dataset's official test set begins (Dataset.test_start), needed only by `test_pool: official`."""
    if num_clients < 1:
        raise PartitionError(f"clients.count={num_clients}: must be at least 1")
    shared = getattr(settings, "samples_per_client", None) is not None  # each client draws its own samples
    if num_clients * 2 > len(labels) and not shared:
        raise PartitionError(
            f"clients.count={num_clients}: the dataset has {len(labels)} samples, fewer than 2 per client "
            "(each client needs at least one training and one test sample)"
        )
    if settings.by_label and not np.issubdtype(np.asarray(labels).dtype, np.integer):
        raise PartitionError(
            f"partition.scheme={settings.scheme} splits by class label; this dataset has no integer labels "
            "(use iid, quality or quantity)"
        )
    if settings.test_pool == "official":  # only then the extra argument: a plugin's `splits` may not take it
        return settings.splits(labels, num_clients, seed, groups, test_start)
    return settings.splits(labels, num_clients, seed, groups)


def split_or_refuse(client_id: int, train: np.ndarray, test: np.ndarray) -> ClientSplit:
    """A client of the authors' dealing, refused when a part is empty (their code would divide by zero). Its samples
    stay in the order of their shuffle, the order their DataLoader's shuffles index (clients.batches: authors)."""
    if len(train) == 0 or len(test) == 0:
        raise PartitionError(
            f"partition.draw=authors: client {client_id} gets {len(train)} training and {len(test)} test samples; "
            "every client needs both (use fewer clients or a larger partition.beta)"
        )
    empty = np.arange(0, dtype=np.int64)
    return ClientSplit(client_id, train, test, empty)


def authors_attackers(
    settings: SchemeSettings,
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    count: int,
    groups: np.ndarray | None = None,
    among: int | None = None,
) -> frozenset[int] | None:
    """With `draw: authors`, the `count` attackers the authors' main.py draws next from the same generator
    (uniform without replacement over the first `among` clients, default all, right after the partition);
    None for every other draw."""
    if not (isinstance(settings, _FlameScheme) and settings.draw == "authors"):
        return None
    state = np.random.RandomState(seed)
    settings.authors_assign(np.asarray(labels), num_clients, state, groups)
    chosen = state.choice(range(num_clients if among is None else among), count, replace=False)
    return frozenset(int(c) for c in chosen)


def label_counts(splits: list[ClientSplit], labels: np.ndarray, num_classes: int) -> dict[str, np.ndarray]:
    """Per-client label counts of each split part, shape (clients, classes), for the partition summary."""
    return {
        part: np.stack([np.bincount(labels[getattr(s, part)], minlength=num_classes) for s in splits])
        for part in ("train", "test", "val")
    }
