"""Partial personalization as Pillutla et al. (2022) run it, the base of FedAlt and FedSim (FedAPM, Sec. 4.4): a
selected client resets its shared part to the received u, trains locally (the subclass says how), uploads the
shared part, and the server averages the shared parts (the selected clients', or all m clients' latest)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.averaging import WeightedUpload, weighted_average
from raysim.algorithms.families.consensus import DeltaUpload, RunningMeanState, running_mean, start_running_mean
from raysim.algorithms.families.split import SplitSettings, deviation, personal_mask, shared_segments
from raysim.algorithms.interface import Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import Request, Result, SGDResult, Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.models.spec import ParamSpec


class PartialSettings(SGDSettings, SplitSettings):
    """FedAlt's settings, which FedSim extends."""

    epochs: int = Field(3, ge=1, description="E: local epochs of each phase; 3 in the FedAPM paper")
    lr: float = Field(0.1, gt=0, description="local learning rate of both parts' SGD (at round 0 with lr_decay)")
    aggregation: Literal["uniform", "samples"] = Field("uniform", description="weights of the shared-part average")
    average_over: Literal["selected", "all"] = Field(
        "selected",
        description="clients in the server's mean: this round's selected ones (Pillutla et al.), or all m with the "
        "latest shared part of each, stale ones included (the FedAPM authors' code; uniform weights)",
    )
    order: Literal["personal_first", "shared_first"] = Field(
        "personal_first",
        description="local phases: personal part then shared part (Gauss-Seidel, FedAPM, Sec. 4.4), or the received "
        "shared part first (the FedAPM authors' unimodal path, with the body personal and the head shared)",
    )

    @model_validator(mode="after")
    def _check_average(self) -> PartialSettings:
        if self.average_over == "all" and self.aggregation != "uniform":
            raise ValueError("algorithm.average_over='all' averages uniformly: set algorithm.aggregation='uniform'")
        return self


@dataclass
class PartialClientState:
    params: Vector
    """v_i on the personal coordinates; the shared ones hold the last trained shared part."""


@dataclass
class PartialServerState:
    u: Vector
    template: Vector
    """Initial full model: the personal part of the GM."""
    latest: RunningMeanState | None = None
    """average_over = all: the sum of all m clients' latest shared parts (u is its mean); None: selected."""


class PartialPersonalization(
    Algorithm[PartialSettings, PartialClientState, PartialServerState, Vector, WeightedUpload | DeltaUpload]
):
    Upload = WeightedUpload  # a DeltaUpload (the change of the latest shared part) with average_over: all
    scales_loss = True

    def __init__(self, settings: PartialSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.personal = personal_mask(settings, params)
        self.shared = ~self.personal
        self.segments = shared_segments(params, self.shared)
        """The shared tensors' ranges in the shared part, which every client step's deviation reads."""

    def init_server(self, init_params: Vector, num_clients: int) -> PartialServerState:
        u = init_params[self.shared].copy()
        latest = start_running_mean(u, num_clients) if self.settings.average_over == "all" else None
        return PartialServerState(u, init_params.copy(), latest)

    def init_client(self, client: ClientInfo, init_params: Vector) -> PartialClientState:
        return PartialClientState(init_params.copy())

    def broadcast(self, server: PartialServerState) -> Vector:
        return server.u

    def local_training(self, start: Vector, num_clients: int) -> Generator[Request, Result, SGDResult]:
        """Gauss-Seidel: personal part, then shared part (`order: shared_first`: the other way round)."""
        first, second = (self.personal, self.shared)
        if self.settings.order == "shared_first":
            first, second = second, first
        s = self.settings
        trained = yield from train(s.scaled(s.local_sgd(start, mask=first), num_clients))
        return (yield from train(s.scaled(s.local_sgd(trained.params, mask=second), num_clients)))

    def client_step(self, client: ClientInfo, state: PartialClientState, broadcast: Vector) -> ClientStep:
        start = state.params.copy()
        start[self.shared] = broadcast
        result = yield from self.local_training(start, client.num_clients)
        params = result.params.astype(np.float32)
        per_tensor, l2 = deviation(self.params, self.shared, params[self.shared], broadcast, segments=self.segments)
        weight = float(client.num_train) if self.settings.aggregation == "samples" else 1.0
        metrics = {"train_loss": result.mean_loss, "deviation": per_tensor, "deviation_l2": l2}
        shared = params[self.shared].astype(np.float64)
        if self.settings.average_over == "all":  # the change of this client's latest shared part
            change = shared - state.params[self.shared].astype(np.float64)
            return ClientUpdate(PartialClientState(params), DeltaUpload(change), metrics)
        upload = WeightedUpload(weight * shared, weight)
        return ClientUpdate(PartialClientState(params), upload, metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """The client's latest shared part (with `average_over: all` it uploads its change)."""
        return update.state.params[self.shared].astype(np.float64)

    def server_step(self, server: PartialServerState, total: WeightedUpload | DeltaUpload, num_selected: int):
        if server.latest is not None:  # average_over = all: u = (1/m) sum over all m of the latest shared parts
            latest, metrics = running_mean(server.latest, total)
            return PartialServerState(latest.w, server.template, latest), metrics
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
