"""The shared-part family: methods that train the personal part of a split model first and then the shared part,
which the server averages (FedRep, LG-FedAvg; Collins et al. 2021, Liang et al. 2020)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.interface import (
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.requests import Number, Request, Result, SGDResult, Vector
from raysim.algorithms.settings import SGDSettings
from raysim.models.spec import ParamSpec


class SharedPartSettings(SGDSettings):
    """Local SGD and the weights of the shared part's average (FedRep, LG-FedAvg)."""

    aggregation: Literal["uniform", "samples"] = Field(
        "uniform", description="weights of the shared part's average: equal (the papers; FedSLR's code) or n_i"
    )


@dataclass
class PersonalPartState:
    """The part of the model that never leaves the client (FedRep: the head; LG-FedAvg: the local layers)."""

    personal: Vector


@dataclass
class SharedPartServerState:
    shared: Vector
    """The global shared part (FedRep: the body; LG-FedAvg: the global layers)."""
    template: Vector
    """The initial full model: the personal part of the GM."""


P = TypeVar("P", bound=SharedPartSettings)


class SharedPartAlgorithm(Algorithm[P, PersonalPartState, SharedPartServerState, Vector, WeightedUpload]):
    """A personal part kept by each client and a shared part averaged over the selected clients, the only part
    sent either way; subclasses say which part is personal and how a client trains."""

    Upload = WeightedUpload
    stacks = True
    scales_loss = True

    def __init__(self, settings: P, params: ParamSpec):
        super().__init__(settings, params)
        self.personal = self.personal_part(params)
        self.shared = ~self.personal

    @abstractmethod
    def personal_part(self, params: ParamSpec) -> np.ndarray:
        """Boolean mask of the personal coordinates (a ConfigError when nothing would be shared)."""

    @abstractmethod
    def local_training(
        self, start: Vector, num_clients: int
    ) -> Generator[Request, Result, tuple[SGDResult, dict[str, Number]]]:
        """The round's local SGD from the full model `start`: the result whose params are the new model, and
        metrics of earlier phases."""

    def init_server(self, init_params: Vector, num_clients: int) -> SharedPartServerState:
        return SharedPartServerState(init_params[self.shared].copy(), init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> PersonalPartState:
        return PersonalPartState(init_params[self.personal].copy())

    def broadcast(self, server: SharedPartServerState) -> Vector:
        return server.shared

    def assemble(self, personal: Vector, shared: Vector) -> Vector:
        """The full model(s) of a personal part (one, or a chunk's rows) and a shared part."""
        full = np.empty((*personal.shape[:-1], self.params.size), np.float32)
        full[..., self.personal] = personal
        full[..., self.shared] = shared
        return full

    def client_step(self, client: ClientInfo | ClientChunk, state: PersonalPartState, broadcast: Vector) -> ClientStep:
        start = self.assemble(state.personal, broadcast)
        result, metrics = yield from self.local_training(start, client.num_clients)
        params = np.asarray(result.params, np.float32)
        shared = params[..., self.shared]
        weight = upload_weight(client.num_train, self.settings.aggregation)  # a number, or one per row of a chunk
        metrics = {
            "train_loss": result.mean_loss,
            "shared_change": np.linalg.norm(np.asarray(shared, np.float64) - broadcast, axis=-1),
            **metrics,
        }
        new = PersonalPartState(params[..., self.personal])
        return ClientUpdate(new, WeightedUpload(per_row(weight) * shared, weight), metrics)

    def server_step(self, server: SharedPartServerState, total: WeightedUpload, num_selected: int):
        shared, metrics = weighted_average(total, server.shared)  # sum_i a_i x_i / sum_i a_i over the selected
        return SharedPartServerState(shared, server.template), metrics

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.shared]

    def global_model(self, server: SharedPartServerState) -> Vector:
        return self.assemble(server.template[self.personal], server.shared)

    def evaluated_model(self, state: PersonalPartState, global_params: Vector) -> Vector:
        """The latest global shared part with the client's own personal part."""
        return self.assemble(state.personal, global_params[self.shared])
