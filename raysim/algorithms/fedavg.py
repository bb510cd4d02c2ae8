"""FedAvg: clients run local SGD from the global model; the server averages the results (flame.md 2.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    LocalSGD,
    SGDSettings,
    Vector,
    per_row,
    train,
)
from raysim.algorithms.servers import WeightedUpload, weighted_average
from raysim.jit import distances


class FedAvgSettings(SGDSettings):
    name: Literal["fedavg"] = "fedavg"
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weight local models by training-set size (McMahan et al.) or equally"
    )


@dataclass
class FedAvgClientState:
    """FedAvg keeps nothing on the client between rounds."""


@dataclass
class FedAvgServerState:
    w: Vector


@ALGORITHMS.register()
class FedAvg(Algorithm[FedAvgSettings, FedAvgClientState, FedAvgServerState, Vector, WeightedUpload]):
    name = "fedavg"
    Settings = FedAvgSettings
    Upload = WeightedUpload
    stacks = True
    scales_loss = True

    def init_server(self, init_params: Vector, num_clients: int) -> FedAvgServerState:
        return FedAvgServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedAvgClientState:
        return FedAvgClientState()

    def broadcast(self, server: FedAvgServerState) -> Vector:
        return server.w

    def local_request(self, broadcast: Vector) -> LocalSGD:
        """The local training of a round (FedProx adds its proximal term here)."""
        return self.settings.local_sgd(broadcast)

    def client_step(self, client: ClientInfo | ClientChunk, state: FedAvgClientState, broadcast: Vector) -> ClientStep:
        result = yield from train(self.settings.scaled(self.local_request(broadcast), client.num_clients))
        samples = np.asarray(client.num_train, np.float32)  # a number, or one per row of a chunk
        weight = samples if self.settings.aggregation == "samples" else np.ones_like(samples)
        metrics = {"train_loss": result.mean_loss, "update_norm": distances(result.params, broadcast)}
        return ClientUpdate(state, WeightedUpload(per_row(weight) * result.params, weight), metrics)

    def server_step(self, server: FedAvgServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # w = sum_i n_i theta_i / sum_i n_i (or uniform)
        return FedAvgServerState(w), metrics

    def global_model(self, server: FedAvgServerState) -> Vector:
        return server.w
