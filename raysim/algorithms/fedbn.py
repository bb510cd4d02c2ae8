"""FedBN: FedAvg with local BatchNorm (Li et al., ICLR 2021).

Li, Jiang, Zhang, Kamp and Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization",
arXiv:2102.07623, Algorithm 1. Every layer is federated as in FedAvg except the normalization layers: their affine
parameters (gamma, beta) and running statistics (mean, variance) never leave the client. A selected client trains
the whole model for `epochs` epochs from its own normalization layers and the received rest,

    (bn_i, w_i) <- `epochs` epochs of SGD on f_i(bn, w) from (bn_i, w),

and uploads w_i; the server averages w <- sum_i a_i w_i / sum_i a_i over the selected clients, a_i = 1 (the
authors' code, `client_weights = 1/client_num`) or n_i (`aggregation: samples`). The GM is w with the initial
normalization layers (FedBN has no global normalization: the paper scores each client with its own); each client's
PM is its own normalization layers with the latest w.

Its models are those with normalization layers: the zoo's BatchNorm variants (mlp_bn, cnn_bn, resnet18_bn,
resnet8x4_bn, resnet32x4_bn), whose running statistics the model vector carries (docs/usage.md, Running
statistics); a model with GroupNorm keeps its GroupNorm layers local the same way. It is LG-FedAvg's server and
state (raysim.algorithms.families.shared_part) with the split `normalization`.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Literal

import numpy as np

from raysim.algorithms.families.shared_part import SharedPartAlgorithm, SharedPartSettings
from raysim.algorithms.families.split import SplitSettings, personal_mask
from raysim.algorithms.interface import ALGORITHMS
from raysim.algorithms.requests import Number, Request, Result, SGDResult, Vector, train
from raysim.errors import ConfigError
from raysim.examples import ExampleContext, Fragment
from raysim.models.spec import ParamSpec


class FedBNSettings(SharedPartSettings):
    name: Literal["fedbn"] = "fedbn"


@ALGORITHMS.register()
class FedBN(SharedPartAlgorithm[FedBNSettings]):
    """FedAvg over everything but the normalization layers, which each client keeps."""

    name = "fedbn"
    Settings = FedBNSettings

    def personal_part(self, params: ParamSpec) -> np.ndarray:
        """The normalization layers' parameters and running statistics (the split preset `normalization`)."""
        if not params.normalization:
            raise ConfigError(
                f"algorithm.name=fedbn keeps the normalization layers local, and model {params.model or '(unnamed)'!r} "
                "has none: choose a model with BatchNorm (mlp_bn, cnn_bn, resnet18_bn, resnet8x4_bn, resnet32x4_bn)"
            )
        return personal_mask(SplitSettings(name=self.name, preset="normalization"), params)

    def local_training(
        self, start: Vector, num_clients: int
    ) -> Generator[Request, Result, tuple[SGDResult, dict[str, Number]]]:
        """(bn_i, w_i): `epochs` epochs of SGD on the whole model from the client's bn_i and the received w."""
        s = self.settings
        return (yield from train(s.scaled(s.local_sgd(start), num_clients))), {}

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """FedBN on the zoo's BatchNorm MLP."""
        return {"algorithm": {"name": cls.name}, "model": {"name": "mlp_bn"}}
