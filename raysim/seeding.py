"""Named random streams derived from the experiment seed.

Every random choice in a run draws from a stream keyed by (seed, purpose, ...ids), so a client's
randomness depends only on the seed, its id and the round, never on which host actor runs it or in
what order. That is what makes results independent of the number of host actors.
"""

from __future__ import annotations

import os
from enum import IntEnum
from typing import TYPE_CHECKING, Literal

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
    EVALUATION = 9


def rng(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """A numpy generator for one purpose; `keys` narrow it further (client id, round, ...)."""
    return np.random.default_rng([seed, int(stream), *[int(k) for k in keys]])


def torch_seed(seed: int, stream: Stream, *keys: int) -> int:
    """A 63-bit torch seed for one purpose, derived like `rng`."""
    return int(rng(seed, stream, *keys).integers(0, 2**63 - 1))


def torch_generator(seed: int, stream: Stream, *keys: int) -> torch.Generator:
    import torch  # only where torch runs: processes that merely draw numbers never import it

    return torch.Generator().manual_seed(torch_seed(seed, stream, *keys))


Kernels = Literal["fast", "cudnn", "all"]
"""`runtime.deterministic`: which of torch's kernels must give the same bits on every run (RuntimeSettings)."""


def use_kernels(kernels: Kernels) -> None:
    """Set this process's torch kernel choice (the FLAME authors' setup_seed sets
    torch.backends.cudnn.deterministic = True): `cudnn` deterministic cuDNN convolutions, no benchmarking; `all`
    also torch.use_deterministic_algorithms (an op without a deterministic kernel raises, naming itself; cuBLAS
    gets the fixed workspace it then needs); `fast` lets cuDNN benchmark and pick its fastest, nondeterministic
    kernels. Every value is set, so a reused process (runtime.reuse_actors) takes the new run's. On a CPU the cuDNN
    flags change nothing; `all` still checks the CPU ops."""
    import torch

    if kernels == "all":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts (CUDA's note)
    torch.backends.cudnn.deterministic = kernels != "fast"
    torch.backends.cudnn.benchmark = kernels == "fast"
    if torch.are_deterministic_algorithms_enabled() != (kernels == "all"):
        # only on a change: the call imports torch's compiler stack (torch._dynamo), 1.5 s of every process's start
        torch.use_deterministic_algorithms(kernels == "all")
