"""FedSim: partial personalization with simultaneous updates of both parts (fedapm.md 4.3).

Pillutla et al.'s Jacobi baseline: like FedAlt (shared part reset to the received u, shared part uploaded and
averaged), but every mini-batch step updates the personal and the shared part together.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Literal

from raysim.algorithms.base import ALGORITHMS, Request, Result, SGDResult, Vector, train
from raysim.algorithms.fedalt import FedAlt, FedAltSettings


class FedSimSettings(FedAltSettings):
    name: Literal["fedsim"] = "fedsim"  # type: ignore[assignment]  # its own, extending FedAlt's settings


@ALGORITHMS.register()
class FedSim(FedAlt):
    name = "fedsim"
    Settings = FedSimSettings

    def local_training(self, start: Vector) -> Generator[Request, Result, SGDResult]:
        """Jacobi: one pass of SGD over the whole model."""
        return (yield from train(self.settings.local_sgd(start)))
