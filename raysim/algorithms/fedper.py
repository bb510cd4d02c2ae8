"""FedPer: federated base layers, personal top layers, trained together (Arivazhagan, Aggarwal, Singh and Choudhary,
"Federated Learning with Personalization Layers", arXiv:1912.00818, Algorithm 1).

A selected client trains its whole model, the received base layers W_B with its own personalization layers W_P,
for `epochs` epochs of SGD,

    (W_B,i, W_P,i) <- `epochs` epochs of SGD on f_i(W_B, W_P) from (W_B, W_P,i),

and uploads W_B,i; the server averages the base layers weighted by n_i (Algorithm 1, as FedAvg; `aggregation:
uniform` for equal weights). The personalization layers never leave the client. The GM is the base layers with the
common initial top layers; each client's PM is its own top layers with the latest base.

The personalization layers are `personal` (fnmatch patterns) or `preset`: `last_layer` by default (the classifier,
FL-bench's and PFLlib's FedPer), `output` for every layer after the last convolution (the paper's two top layers of
its CNNs). It is FedRep's `phases: joint` under another name and default weighting (tests check they coincide):
LG-FedAvg's and FedRep's state and server (raysim.algorithms.families.shared_part).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.shared_part import SharedPartAlgorithm, SharedPartSettings
from raysim.algorithms.families.split import Preset, SplitSettings, personal_mask
from raysim.algorithms.interface import ALGORITHMS
from raysim.algorithms.requests import Number, Request, Result, SGDResult, Vector, train
from raysim.models.spec import ParamSpec


class FedPerSettings(SharedPartSettings, SplitSettings):
    name: Literal["fedper"] = "fedper"
    preset: Preset = Field(
        "last_layer", description="the personalization layers: last_layer (the classifier), output, or another preset"
    )
    aggregation: Literal["uniform", "samples"] = Field(
        "samples", description="weights of the base layers' average: n_i (the paper's FedAvg) or equal"
    )


@ALGORITHMS.register()
class FedPer(SharedPartAlgorithm[FedPerSettings]):
    """FedAvg over the base layers; each client keeps its personalization layers; one joint local phase."""

    name = "fedper"
    Settings = FedPerSettings

    def personal_part(self, params: ParamSpec) -> np.ndarray:
        """The personalization layers (a ConfigError if they are none or everything)."""
        return personal_mask(self.settings, params)

    def local_training(
        self, start: Vector, num_clients: int
    ) -> Generator[Request, Result, tuple[SGDResult, dict[str, Number]]]:
        """(W_B,i, W_P,i): `epochs` epochs of SGD on the whole model from the received base and the own top."""
        s = self.settings
        return (yield from train(s.scaled(s.local_sgd(start), num_clients))), {}
