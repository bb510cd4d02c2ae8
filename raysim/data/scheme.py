"""What a partition scheme is (`partition.scheme`): a settings class that deals the samples to the clients, and the
registry the config chooses it from (PARTITIONS). The built-in schemes (raysim.data.partitions, meta_partition,
partition_file) register here exactly as a plugin's do.

A scheme implements `assign` (the sample indices of each client); each client's samples are then shuffled and
split into train / test (/ validation) here, per client, from the scheme's fractions (flame.md 6.1: 80/20 per
client, so test data follow the client's distribution). A scheme that makes its splits itself overrides `splits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from pydantic import Field

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
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="per-client share held out for testing")
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of each client's training part held out for the HM-val choice"
    )
    by_label: ClassVar[bool] = False
    """The scheme deals by class label, so it refuses a dataset without integer labels (a regression target)."""

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
        self, labels: np.ndarray, num_clients: int, seed: int, groups: np.ndarray | None
    ) -> list[ClientSplit]:
        """Every client's train / test / val indices: `assign`, each client's share split by `split_client`, and
        the scheme's noise levels."""
        parts = self.assign(labels, num_clients, rng(seed, Stream.PARTITION), groups)
        splits = [
            split_client(client, indices, self, rng(seed, Stream.PARTITION, 1, client))
            for client, indices in enumerate(parts)
        ]
        return self.with_noise(splits, num_clients)

    def with_noise(self, splits: list[ClientSplit], num_clients: int) -> list[ClientSplit]:
        """`splits` with each client's `noise_std`."""
        noisy = []
        for split in splits:
            noise = self.noise_std(split.client_id, num_clients)
            noisy.append(ClientSplit(split.client_id, split.train, split.test, split.val, noise) if noise else split)
        return noisy


def split_client(
    client_id: int, indices: np.ndarray, settings: SchemeSettings, generator: np.random.Generator
) -> ClientSplit:
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


def _check_scheme(name: str, entry: type[SchemeSettings]) -> None:
    if not (isinstance(entry, type) and issubclass(entry, SchemeSettings)):
        raise TypeError(f"partition scheme {name!r}: {entry!r} must subclass raysim.data.scheme.SchemeSettings")


PARTITIONS: Registry[type[SchemeSettings]] = Registry(
    "partition scheme", "partition.scheme", settings=lambda entry: entry, check=_check_scheme
)
"""The partition schemes by `partition.scheme`: settings classes registered with `@PARTITIONS.register()`."""
