"""What a partition scheme is (`partition.scheme`): a settings class that deals the samples to the clients, and the
registry the config chooses it from (PARTITIONS). The built-in schemes (raysim.data.partitions, meta_partition,
partition_file) register here exactly as a plugin's do.

A scheme implements `assign` (the sample indices of each client); each client's samples are then shuffled and
split into train / test (/ validation) here, per client, from the scheme's fractions (the FLAME authors' code: 80/20
per client, so test data follow the client's distribution). A scheme that makes its splits itself overrides `splits`.

`test_split: global` instead holds out one shared test split of the whole dataset before `assign` deals the rest,
and scores every client on it (FedAPM's CrisisMMD code; FedAPM, Table 2, App. B.1); `test_split: matched` holds
the same pool out and draws each client's own test set from it with the client's training label shares (FedSLR,
FedSLR, App. B.1). `test_pool: official` makes that pool the dataset's own test set (CIFAR's test batch), so that the
scheme deals the official training set alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.errors import PartitionError
from raysim.examples import ExampleContext, Fragment
from raysim.registry import Registry
from raysim.seeding import Stream, rng
from raysim.settings import Settings


@dataclass(frozen=True)
class ClientSplit:
    """The sample indices (into the whole dataset) that one client holds."""

    client_id: int
    train: np.ndarray
    test: np.ndarray
    val: np.ndarray
    noise_std: float = 0.0
    """Std of the Gaussian noise added to this client's features at every access (quality skew)."""

    @property
    def num_samples(self) -> int:
        return len(self.train) + len(self.test) + len(self.val)


class SchemeSettings(Settings):
    """The base of every scheme's settings; a subclass sets `scheme: Literal["its_name"] = "its_name"`."""

    scheme: str
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="per-client share held out for testing (test_split global: of the dataset)"
    )
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of each client's training part held out for the HM-val choice"
    )
    test_split: Literal["client", "global", "matched"] = Field(
        "client",
        description="client: each client's own test_fraction of its samples; global: a test pool held out before "
        "the dealing, one test split every client is scored on (FedAPM's CrisisMMD); matched: each client's own "
        "test_samples drawn from that pool with its training label shares, floor(share * test_samples) per label "
        "(FedSLR, App. B.1)",
    )
    test_pool: Literal["held_out", "official"] = Field(
        "held_out",
        description="the test pool of test_split global or matched (and of label_prior): held_out = a test_fraction "
        "of the pooled dataset; official = the dataset's own test set (CIFAR's test batch, Tiny-ImageNet's val "
        "folder), the scheme then dealing its official training set alone (FedSLR, App. B.1: 500 samples a client)",
    )
    test_samples: int = Field(
        100,
        ge=1,
        description="test_split matched (and label_prior): per client, floor(label share * test_samples) per label",
    )
    by_label: ClassVar[bool] = False
    """The scheme deals by class label, so it refuses a dataset without integer labels (a regression target)."""
    global_test: ClassVar[bool] = True
    """The scheme's clients can share one global test split (False for schemes that draw their own test sets)."""
    own_test_pool: ClassVar[bool] = False
    """The scheme draws its test sets from `test_pool` itself, whatever `test_split` says (label_prior)."""

    @model_validator(mode="after")
    def _check_test_split(self):
        if self.test_split != "client" and not self.global_test:
            raise ValueError(
                f"partition.test_split={self.test_split}: partition.scheme={self.scheme} draws its own test sets; use "
                "test_split client"
            )
        if self.test_pool == "official" and not self.own_test_pool:
            if not self.global_test:
                raise ValueError(
                    f"partition.test_pool=official: partition.scheme={self.scheme} draws its own test sets; use "
                    "test_pool held_out"
                )
            if self.test_split == "client":
                raise ValueError(
                    "partition.test_pool=official is the test pool of test_split global or matched; with test_split "
                    "client each client's test part is its own samples"
                )
        return self

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """The config sections under which this scheme runs in a small experiment (raysim.examples): its default
        settings; a scheme that cannot run without other settings (e.g. a dataset) names them too."""
        return {"partition": {"scheme": cls.model_fields["scheme"].default}}

    def assign(
        self, labels: np.ndarray, num_clients: int, generator: np.random.Generator, groups: np.ndarray | None
    ) -> list[np.ndarray]:
        """The sample indices of each client (before the per-client train/test split); `groups` are the dataset's
        natural ids (None if it has none)."""
        raise NotImplementedError(f"partition.scheme={self.scheme} implements no assign")

    def noise_std(self, client: int, num_clients: int) -> float:
        """Std of the Gaussian feature noise added to this client's samples at access time (0: none)."""
        return 0.0

    def server_pools(self, num_samples: int, seed: int) -> tuple[np.ndarray, ...]:
        """Pools of sample indices that no client holds, kept back for the server (none by default)."""
        return ()

    def malicious(self, labels: np.ndarray, num_clients: int) -> frozenset[int] | None:
        """The clients this partition marks as attackers (a partition file's); None: it marks none."""
        return None

    def splits(
        self,
        labels: np.ndarray,
        num_clients: int,
        seed: int,
        groups: np.ndarray | None,
        test_start: int | None = None,
    ) -> list[ClientSplit]:
        """Every client's train / test / val indices: `assign`, each client's share split by `split_client`, and
        the scheme's noise levels. With `test_split: global` or `matched`, `assign` deals only the samples outside
        the test pool (`global_test_split`, or with `test_pool: official` the samples before `test_start`, the
        dataset's official training set), and every client's test split is the pool (global) or its label-matched
        draw from it (`matched_test`)."""
        labels = np.asarray(labels)
        shared = None
        pool = np.arange(len(labels))
        if self.test_split != "client":
            shared, pool = test_and_train_pools(self, len(labels), num_clients, seed, test_start)
        pool_groups = None if groups is None else np.asarray(groups)[pool]
        parts = self.assign(labels[pool], num_clients, rng(seed, Stream.PARTITION), pool_groups)
        splits = []
        for client, indices in enumerate(parts):
            test = shared
            if shared is not None and self.test_split == "matched":
                test = matched_test(self, labels, pool[indices], shared, rng(seed, Stream.PARTITION, 3, client), client)
            splits.append(split_client(client, pool[indices], self, rng(seed, Stream.PARTITION, 1, client), test))
        return self.with_noise(splits, num_clients)

    def with_noise(self, splits: list[ClientSplit], num_clients: int) -> list[ClientSplit]:
        """`splits` with each client's `noise_std`."""
        noisy = []
        for split in splits:
            noise = self.noise_std(split.client_id, num_clients)
            noisy.append(ClientSplit(split.client_id, split.train, split.test, split.val, noise) if noise else split)
        return noisy


def global_test_split(
    num_samples: int, test_fraction: float, num_clients: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The shared test split of `test_split: global` (a uniform `test_fraction` of the samples, from its own
    stream) and the sorted rest that the scheme deals to the clients."""
    held = round(test_fraction * num_samples)
    if held < 1 or num_samples - held < num_clients:
        raise PartitionError(
            f"partition.test_split=global: partition.test_fraction={test_fraction} holds out {held} of "
            f"{num_samples} samples, leaving {num_samples - held} for clients.count={num_clients}; both the test "
            "split and one sample per client are needed"
        )
    order = rng(seed, Stream.PARTITION, 2).permutation(num_samples)
    return np.sort(order[:held]), np.sort(order[held:])


def test_and_train_pools(
    settings: SchemeSettings, num_samples: int, num_clients: int, seed: int, test_start: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """(test pool, training pool) of `settings.test_pool`: a held-out `test_fraction` (global_test_split), or the
    dataset's official test set [test_start, n) and training set [0, test_start)."""
    if settings.test_pool == "held_out":
        return global_test_split(num_samples, settings.test_fraction, num_clients, seed)
    if test_start is None or not 0 < test_start < num_samples:
        raise PartitionError(
            "partition.test_pool=official: this dataset has no official test set (its source records none); use "
            "test_pool held_out"
        )
    if test_start < num_clients:
        raise PartitionError(
            f"partition.test_pool=official: the official training set holds {test_start} samples, fewer than "
            f"clients.count={num_clients}"
        )
    return np.arange(test_start, num_samples), np.arange(test_start)


def matched_test(
    settings: SchemeSettings,
    labels: np.ndarray,
    trained: np.ndarray,
    test_pool: np.ndarray,
    generator: np.random.Generator,
    client: int,
) -> np.ndarray:
    """A client's test set matched to its training labels (FedSLR, App. B.1, the authors' code): floor(share *
    test_samples) samples of each label it trains on, drawn without replacement from that label's part of
    `test_pool` (other clients may draw the same ones)."""
    if not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(
            f"partition.test_split={settings.test_split} draws each label's share; this dataset has no integer labels"
        )
    present, counts = np.unique(labels[trained], return_counts=True)
    wanted = counts * settings.test_samples // len(trained)  # floor(share * test_samples), exactly
    if wanted.sum() == 0:
        raise PartitionError(
            f"partition.test_samples={settings.test_samples} gives client {client} no test sample (its largest "
            f"label share is {counts.max() / len(trained):.3f}); raise partition.test_samples"
        )
    pool_labels = labels[test_pool]
    test = []
    for k, count in zip(present.tolist(), wanted.tolist(), strict=True):
        available = test_pool[pool_labels == k]
        if count > len(available):
            raise PartitionError(
                f"partition.test_samples={settings.test_samples}: client {client} needs {count} test samples of "
                f"class {k} but the test pool (partition.test_pool={settings.test_pool}, test_fraction="
                f"{settings.test_fraction}) has {len(available)}; lower partition.test_samples"
            )
        test.append(generator.choice(available, count, replace=False))
    return np.sort(np.concatenate(test))


def split_client(
    client_id: int,
    indices: np.ndarray,
    settings: SchemeSettings,
    generator: np.random.Generator,
    shared_test: np.ndarray | None = None,
) -> ClientSplit:
    """Shuffle a client's samples and split them into train / test (/ validation); with a `shared_test` split
    (test_split global) the client's samples are all train (/ validation) and its test split is the shared one."""
    shuffled = generator.permutation(indices)
    n_test = 0 if shared_test is not None else max(1, round(settings.test_fraction * len(shuffled)))
    n_val = round(settings.val_fraction * (len(shuffled) - n_test))
    if settings.val_fraction > 0:
        n_val = max(1, n_val)
    if len(shuffled) - n_test - n_val < 1:
        raise PartitionError(
            f"client {client_id} holds {len(shuffled)} samples, too few for partition.test_fraction="
            f"{settings.test_fraction} and partition.val_fraction={settings.val_fraction}"
        )
    test, val, train = np.split(shuffled, [n_test, n_test + n_val])
    return ClientSplit(client_id, np.sort(train), np.sort(test) if shared_test is None else shared_test, np.sort(val))


def _check_scheme(name: str, entry: type[SchemeSettings]) -> None:
    if not (isinstance(entry, type) and issubclass(entry, SchemeSettings)):
        raise TypeError(f"partition scheme {name!r}: {entry!r} must subclass raysim.data.scheme.SchemeSettings")


PARTITIONS: Registry[type[SchemeSettings]] = Registry(
    "partition scheme", "partition.scheme", settings=lambda entry: entry, check=_check_scheme
)
"""The partition schemes by `partition.scheme`: settings classes registered with `@PARTITIONS.register()`."""
