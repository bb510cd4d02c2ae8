"""FedLP as AugFL compares against it (AugFL, Sec. VI, Fig. 5): FedAvg whose global model starts
from the pretrained model (PM) instead of a random initialization.

AugFL (Yue et al., 2025, arXiv:2503.02154) lists it among the PM-aided baselines as "FedLP [46]: initialize client
models with the PM", which requires the PM to have the clients' architecture (their Fig. 5 setup uses a pretrained
ResNet8x4 as the client model); the paper states nothing else of it, and the source of [46] was not at hand, so
this is the method as AugFL states it: w^0 = theta_p, then FedAvg rounds (FLAME, Sec. IV-E; `AveragingSettings` all
apply), the GM deployed on every client, held-out ones included (as AugFL's FedAvg column).

theta_p comes from AugFL's pretrained-model machinery (raysim.algorithms.augfl.teacher): the weights file
`teacher_weights` (`raysim pretrain`), or a model of the clients' architecture pretrained on the first pool the `meta`
partition keeps back (`teacher_*` recipe, cached). It reaches `setup_server` on the coordinator only, and clients see
it only as the first broadcast, as any initial model."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import model_validator

from raysim.algorithms.families.averaging import Averaging, AveragingServerState, AveragingSettings
from raysim.algorithms.families.teacher import PretrainingSettings, pretrained_parameters
from raysim.algorithms.interface import ALGORITHMS, ServerContext
from raysim.algorithms.requests import ServerDataStep, Vector
from raysim.examples import ExampleContext, Fragment


class FedLpSettings(AveragingSettings, PretrainingSettings):
    name: Literal["fedlp"] = "fedlp"

    @model_validator(mode="after")
    def _whole_model(self) -> FedLpSettings:
        """The PM reaches the coordinator only, so clients cannot keep a shared part of their own from it."""
        if self.shared_only:
            raise ValueError("algorithm.shared_only: FedLP starts the whole model from the PM; set it false")
        return self


@ALGORITHMS.register()
class FedLp(Averaging):
    name = "fedlp"
    Settings = FedLpSettings
    settings: FedLpSettings
    _pretrained: np.ndarray | None = None

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """FedLP on the meta partition, whose first held-back pool pretrains the PM (one epoch)."""
        from raysim.data.meta_partition import MetaSettings

        return {"algorithm": {"name": cls.name, "teacher_epochs": 1}, **MetaSettings.example(context)}

    def server_data(self, context: ServerContext) -> ServerDataStep:
        """theta_p of the clients' own architecture (raysim.algorithms.augfl.teacher.pretrained_parameters)."""
        return pretrained_parameters(self.settings, context, context.model)

    def setup_server(self, data: np.ndarray) -> None:
        if data.shape != (self.params.size,):
            raise ValueError(f"FedLP: the PM has {data.size} parameters, the model {self.params.size}")
        self._pretrained = data

    def init_server(self, init_params: Vector, num_clients: int) -> AveragingServerState:
        """w^0 = theta_p: the random `init_params` are replaced by the PM's parameters."""
        if self._pretrained is None:
            raise RuntimeError("FedLP: setup_server was not called with the pretrained model")
        return super().init_server(self._pretrained, num_clients)
