"""Named random streams derived from the experiment seed.

Every random choice in a run draws from a stream keyed by (seed, purpose, ...ids), so a client's
randomness depends only on the seed, its id and the round, never on which host actor runs it or in
what order. That is what makes results independent of the number of host actors.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class Stream(IntEnum):
    PARTITION = 1
    MODEL_INIT = 2
    SAMPLING = 3
    CLIENT_TRAINING = 4
    ATTACK = 5
    DATA_NOISE = 6
    SERVER = 7
    ADAPTATION = 8


def rng(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """A numpy generator for one purpose; `keys` narrow it further (client id, round, ...)."""
    return np.random.default_rng([seed, int(stream), *[int(k) for k in keys]])


def torch_seed(seed: int, stream: Stream, *keys: int) -> int:
    """A 63-bit torch seed for one purpose, derived like `rng`."""
    return int(rng(seed, stream, *keys).integers(0, 2**63 - 1))


def torch_generator(seed: int, stream: Stream, *keys: int) -> torch.Generator:
    import torch  # only where torch runs: processes that merely draw numbers never import it

    return torch.Generator().manual_seed(torch_seed(seed, stream, *keys))
