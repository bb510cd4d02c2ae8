"""FedAlt: partial personalization by alternating updates, personal part then shared part (fedapm.md 4.3).

Pillutla et al.'s Gauss-Seidel baseline: a selected client resets its shared part to the received u, trains
its personal part v_i for E epochs with the shared part frozen, then the shared part for E epochs with the
new v_i frozen, and uploads the shared part; the server averages the selected clients' shared parts. It is
FedAPM with pi_i = 0, rho = 0, sigma_i = 0 and u_i <- u at every round start (fedapm.md 1.3).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Request,
    Result,
    SGDResult,
    SGDSettings,
    Vector,
    train,
)
from raysim.algorithms.fedapm import SplitSettings, deviation, personal_mask
from raysim.algorithms.servers import WeightedUpload, weighted_average
from raysim.models.spec import ParamSpec


class FedAltSettings(SGDSettings, SplitSettings):
    name: Literal["fedalt"] = "fedalt"
    epochs: int = Field(3, ge=1, description="E: local epochs of each phase; 3 in the FedAPM paper")
    lr: float = Field(0.1, gt=0)
    aggregation: Literal["uniform", "samples"] = Field("uniform", description="weights of the shared-part average")


@dataclass
class PartialClientState:
    params: Vector
    """v_i on the personal coordinates; the shared ones hold the last trained shared part."""


@dataclass
class PartialServerState:
    u: Vector
    template: Vector
    """Initial full model: the personal part of the GM."""


@ALGORITHMS.register()
class FedAlt(Algorithm[FedAltSettings, PartialClientState, PartialServerState, Vector, WeightedUpload]):
    name = "fedalt"
    Settings = FedAltSettings
    Upload = WeightedUpload

    def __init__(self, settings: FedAltSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.personal = personal_mask(settings, params)
        self.shared = ~self.personal

    def init_server(self, init_params: Vector, num_clients: int) -> PartialServerState:
        return PartialServerState(init_params[self.shared].copy(), init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> PartialClientState:
        return PartialClientState(init_params.copy())

    def broadcast(self, server: PartialServerState) -> Vector:
        return server.u

    def local_training(self, start: Vector) -> Generator[Request, Result, SGDResult]:
        """Gauss-Seidel: personal part, then shared part."""
        personal = yield from train(self.settings.local_sgd(start, mask=self.personal))
        shared = yield from train(self.settings.local_sgd(personal.params, mask=self.shared))
        return shared

    def client_step(self, client: ClientInfo, state: PartialClientState, broadcast: Vector) -> ClientStep:
        start = state.params.copy()
        start[self.shared] = broadcast
        result = yield from self.local_training(start)
        params = result.params.astype(np.float32)
        per_tensor, l2 = deviation(self.params, self.shared, params[self.shared], broadcast)
        weight = float(client.num_train) if self.settings.aggregation == "samples" else 1.0
        metrics = {"train_loss": result.mean_loss, "deviation": per_tensor, "deviation_l2": l2}
        upload = WeightedUpload(weight * params[self.shared].astype(np.float64), weight)
        return ClientUpdate(PartialClientState(params), upload, metrics)

    def server_step(self, server: PartialServerState, total: WeightedUpload, num_selected: int):
        u, metrics = weighted_average(total, server.u)  # weighted mean of the selected shared parts
        return PartialServerState(u, server.template), metrics

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.shared]

    def global_model(self, server: PartialServerState) -> Vector:
        full = server.template.copy()
        full[self.shared] = server.u
        return full

    def personalized_model(self, state: PartialClientState) -> Vector:
        return state.params
