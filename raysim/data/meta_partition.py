"""AugFL's data layout (AugFL, Sec. VI): few-shot clients of 2 classes each, D_i ~ U(M, 2M), and held-back pools
that no client holds (the pretrained model's training data and the server's transfer set, which must stay
disjoint from client data); `MetaSettings.server_pools` hands them to the runtime.

With `test_fraction = 0.5` a client's train split is its support set and its test split its query set.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.data.scheme import PARTITIONS, SchemeSettings
from raysim.errors import PartitionError
from raysim.examples import ExampleContext, Fragment
from raysim.seeding import Stream, rng


@PARTITIONS.register()
class MetaSettings(SchemeSettings):
    """2 random classes per client, D_i ~ U(M, 2M) split evenly over them, none from the reserved pool."""

    scheme: Literal["meta"] = "meta"
    global_test: ClassVar[bool] = False
    test_fraction: float = Field(0.5, gt=0.0, lt=1.0, description="query share of each client (50/50 in the paper)")
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="share of the support part held out as validation")
    classes_per_client: int = Field(2, ge=1, description="classes each client draws at random (2 in the paper)")
    shots: int = Field(20, ge=2, description="M: each client holds D_i ~ U(M, 2M) samples")
    reserved: int = Field(10_000, ge=0, description="samples held by no client for pretraining the teacher model")
    server_samples: int = Field(
        10_000, ge=0, description="further samples held by no client: the server's knowledge-transfer set D_s"
    )

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """Few-shot clients with small held-back pools (the defaults keep back 20,000 samples)."""
        return {"partition": {"scheme": "meta", "shots": 10, "reserved": 500, "server_samples": 256}}

    def assign(self, labels, num_clients, generator, groups):
        labels = np.asarray(labels)
        held = reserved_pool(len(labels), self.reserved + self.server_samples, generator)
        clients_pool = np.setdiff1d(np.arange(len(labels)), held)
        classes = np.unique(labels)
        if self.classes_per_client > len(classes):
            raise PartitionError(
                f"partition.classes_per_client={self.classes_per_client}: the dataset has {len(classes)} classes"
            )
        pools = {c: list(generator.permutation(clients_pool[labels[clients_pool] == c])) for c in classes}
        parts = []
        for client in range(num_clients):
            chosen = generator.choice(classes, self.classes_per_client, replace=False)
            size = int(generator.integers(self.shots, 2 * self.shots + 1))
            counts = np.full(len(chosen), size // len(chosen)) + (np.arange(len(chosen)) < size % len(chosen))
            indices = []
            for c, count in zip(chosen, counts, strict=True):
                if len(pools[c]) < count:
                    raise PartitionError(f"partition.scheme=meta: class {c} ran out at client {client}; fewer clients")
                indices += [pools[c].pop() for _ in range(count)]
            parts.append(np.sort(np.array(indices)))
        return parts

    def server_pools(self, num_samples: int, seed: int) -> tuple[np.ndarray, ...]:
        """The two held-back pools of the partition `partition_dataset(labels, m, self, seed)` makes: the
        pretraining pool (`reserved`), then the server's knowledge-transfer set D_s (`server_samples`)."""
        return reserved_indices(num_samples, self, seed), server_indices(num_samples, self, seed)


def reserved_pool(num_samples: int, reserved: int, generator: np.random.Generator) -> np.ndarray:
    """The indices no client holds, in draw order: the first `reserved` of a seeded permutation (drawn first
    from `generator`)."""
    if reserved >= num_samples:
        raise PartitionError(
            f"partition.reserved + partition.server_samples = {reserved}: the dataset has only {num_samples} samples"
        )
    return generator.permutation(num_samples)[:reserved]


def reserved_indices(num_samples: int, settings: MetaSettings, seed: int) -> np.ndarray:
    """The pretrained model's training pool of the partition `partition_dataset(labels, m, settings, seed)`
    makes (same stream): the first `reserved` held-back samples."""
    held = reserved_pool(num_samples, settings.reserved + settings.server_samples, rng(seed, Stream.PARTITION))
    return np.sort(held[: settings.reserved])


def server_indices(num_samples: int, settings: MetaSettings, seed: int) -> np.ndarray:
    """The server's knowledge-transfer set D_s: the next `server_samples` held-back samples, disjoint from the
    pretraining pool and from every client (AugFL, Sec. VI, which the authors' code does not enforce)."""
    held = reserved_pool(num_samples, settings.reserved + settings.server_samples, rng(seed, Stream.PARTITION))
    return np.sort(held[settings.reserved :])
