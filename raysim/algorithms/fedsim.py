"""FedSim: partial personalization with simultaneous updates of both parts (FedAPM, Secs. 4.4 and 6.1).

Pillutla et al.'s Jacobi baseline: like FedAlt (shared part reset to the received u, shared part uploaded and
averaged), but every mini-batch step updates the personal and the shared part together. It takes FedAlt's
`average_over` and `loss_scale`. (The FedAPM authors' FedSim at their published HEAD trains nothing: see
docs/algorithms.md; this is the algorithm, not that bug.)
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Literal

from pydantic import model_validator

from raysim.algorithms.families.partial import PartialPersonalization, PartialSettings
from raysim.algorithms.interface import ALGORITHMS
from raysim.algorithms.requests import Request, Result, SGDResult, Vector, train


class FedSimSettings(PartialSettings):
    name: Literal["fedsim"] = "fedsim"

    @model_validator(mode="after")
    def _check_order(self) -> FedSimSettings:
        if self.order != "personal_first":
            raise ValueError("algorithm.order: FedSim trains both parts at once; only FedAlt takes 'shared_first'")
        return self


@ALGORITHMS.register()
class FedSim(PartialPersonalization):
    name = "fedsim"
    Settings = FedSimSettings

    def local_training(self, start: Vector, num_clients: int) -> Generator[Request, Result, SGDResult]:
        """Jacobi: one pass of SGD over the whole model."""
        return (yield from train(self.settings.scaled(self.settings.local_sgd(start), num_clients)))
