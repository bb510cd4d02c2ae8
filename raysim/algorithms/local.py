"""Local: every client trains alone and nothing is communicated, the personalization floor.

Each selected client runs local SGD on its own f_i from its previous model. The uploads are empty, so the
server model never moves: the GM is the common initial model and PM is each client's own model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate, Upload
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings


class LocalSettings(SGDSettings):
    name: Literal["local"] = "local"


@dataclass
class LocalClientState:
    theta: Vector


@dataclass
class LocalServerState:
    w: Vector
    """The initial model, never updated."""


@dataclass
class LocalUpload(Upload):
    """Nothing is sent."""


@ALGORITHMS.register()
class Local(Algorithm[LocalSettings, LocalClientState, LocalServerState, None, LocalUpload]):
    name = "local"
    Settings = LocalSettings
    Upload = LocalUpload
    scales_loss = True

    def init_server(self, init_params: Vector, num_clients: int) -> LocalServerState:
        return LocalServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> LocalClientState:
        return LocalClientState(init_params.copy())

    def broadcast(self, server: LocalServerState) -> None:
        return None

    def client_step(self, client: ClientInfo, state: LocalClientState, broadcast: None) -> ClientStep:
        result = yield from train(self.settings.scaled(self.settings.local_sgd(state.theta), client.num_clients))
        return ClientUpdate(LocalClientState(result.params.copy()), LocalUpload(), {"train_loss": result.mean_loss})

    def server_step(self, server: LocalServerState, total: LocalUpload, num_selected: int):
        return server, {}

    def global_model(self, server: LocalServerState) -> Vector:
        return server.w

    def personalized_model(self, state: LocalClientState) -> Vector:
        return state.theta
