"""FedAvg: clients run local SGD from the global model; the server averages the results (flame.md 2.3).

Every client logs the deviation ||theta_i - w|| over the shared tensors of FedAPM's split (`personal` / `preset`,
fedapm.md 4.4 footnote 3: for the non-personalized methods the "shared components" are the same tensors), so that
Table 3's methods compare on one measure; a model the preset cannot split (one layer) counts whole.

`shared_only` is the FedAPM authors' code (fedapm.md 1.5): a client trains only the shared part (the personal part
stays at the common initial model, as the broadcast carries it), and the server averages the latest shared parts of
ALL m clients, stale ones included (u = (1/m) sum_i u_i, the running mean FedAPM's server keeps), unweighted.
`shared_start: local` adds their unimodal path (the MLP/CNN rows): `load_remaining_layers` loads only the head from
the server, so a client's shared part continues from its own latest one and is never synchronized (their FedAvg is
local training of the shared part, FedProx's prox centre is the client's own previous model), and each client's own
model is scored (the PM), not the global one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.averaging import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.families.consensus import DeltaUpload, RunningMeanState, running_mean, start_running_mean
from raysim.algorithms.families.split import SplitSettings, deviation, personal_mask
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.requests import LocalSGD, Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.jit import distances
from raysim.models.spec import ParamSpec


class FedAvgSettings(SGDSettings, SplitSettings):
    name: Literal["fedavg"] = "fedavg"
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weight local models by training-set size (McMahan et al.) or equally"
    )
    shared_only: bool = Field(
        False,
        description="the FedAPM authors' code: train only the shared part of the split (personal / preset), the "
        "personal part frozen at the initial model, and average the latest shared parts of all m clients "
        "(stale ones included, unweighted; `aggregation` does not apply)",
    )
    shared_start: Literal["broadcast", "local"] = Field(
        "broadcast",
        description="with shared_only: where a client's shared part starts each round: the server's mean (the "
        "authors' multimodal path), or the client's own latest shared part, never synchronized (their unimodal "
        "path: FedAvg is then local training, FedProx pulls towards the client's previous model, the PM is scored)",
    )

    @model_validator(mode="after")
    def _check_shared_start(self) -> FedAvgSettings:
        if self.shared_start == "local" and not self.shared_only:
            raise ValueError(
                "algorithm.shared_start='local' is the authors' code's shared-only path: set algorithm.shared_only=true"
            )
        return self


@dataclass
class FedAvgClientState:
    """FedAvg keeps nothing on the client between rounds."""


@dataclass
class SharedOnlyClientState:
    """`shared_only`: the client's latest shared part, the model the authors' server keeps for it."""

    shared: Vector


@dataclass
class FedAvgServerState:
    w: Vector
    running: RunningMeanState | None = None
    """`shared_only`: the mean over all m clients of their latest shared parts (w's shared part), and their sum."""


ClientState = FedAvgClientState | SharedOnlyClientState


@ALGORITHMS.register()
class FedAvg(Algorithm[FedAvgSettings, ClientState, FedAvgServerState, Vector, WeightedUpload | DeltaUpload]):
    name = "fedavg"
    Settings = FedAvgSettings
    Upload = WeightedUpload
    """A DeltaUpload of the shared part with `shared_only`."""
    stacks = True
    scales_loss = True

    def __init__(self, settings: FedAvgSettings, params: ParamSpec):
        super().__init__(settings, params)
        # The whole model is shared where a preset leaves a part empty (FedAvg has no personal part of its own);
        # explicit patterns and the shared-only training need a real split.
        personal = personal_mask(settings, params, allow_empty=settings.personal is None and not settings.shared_only)
        self.shared = ~personal if personal.any() and not personal.all() else np.ones_like(personal)

    def init_server(self, init_params: Vector, num_clients: int) -> FedAvgServerState:
        if not self.settings.shared_only:
            return FedAvgServerState(init_params.copy())
        return FedAvgServerState(init_params.copy(), start_running_mean(init_params[self.shared], num_clients))

    def init_client(self, client: ClientInfo, init_params: Vector) -> ClientState:
        if self.settings.shared_only:
            return SharedOnlyClientState(init_params[self.shared])
        return FedAvgClientState()

    def broadcast(self, server: FedAvgServerState) -> Vector:
        return server.w

    def local_request(self, start: Vector) -> LocalSGD:
        """The local training of a round from `start` (FedProx adds its proximal term towards it here)."""
        return self.settings.local_sgd(start, mask=self.shared if self.settings.shared_only else None)

    def start(self, state: ClientState, broadcast: Vector) -> Vector:
        """The round's starting model: the broadcast, or with `shared_start: local` the broadcast's personal part
        (the common initial one) with the client's own latest shared part (one row per client of a chunk)."""
        if self.settings.shared_start == "broadcast" or not isinstance(state, SharedOnlyClientState):
            return broadcast
        start = np.repeat(broadcast[None], len(state.shared), axis=0) if state.shared.ndim == 2 else broadcast.copy()
        start[..., self.shared] = state.shared
        return start

    def client_step(self, client: ClientInfo | ClientChunk, state: ClientState, broadcast: Vector) -> ClientStep:
        start = self.start(state, broadcast)
        result = yield from train(self.settings.scaled(self.local_request(start), client.num_clients))
        params = np.asarray(result.params, np.float32)
        whole = self.shared.all()  # then no copy of the shared part
        # The deviation is from the server's model even where the client starts from its own (the authors' measure)
        local, received = (params, broadcast) if whole else (params[..., self.shared], broadcast[self.shared])
        per_tensor, l2 = deviation(self.params, self.shared, local, received)
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": distances(params, start),
            "deviation": per_tensor,
            "deviation_l2": l2,
        }
        if isinstance(state, SharedOnlyClientState):  # the change of the latest shared part (families/consensus.py)
            shared = params[..., self.shared]
            message = shared.astype(np.float64)
            return ClientUpdate(SharedOnlyClientState(shared), DeltaUpload(message - state.shared), metrics, message)
        weight = upload_weight(client.num_train, self.settings.aggregation)  # a number, or one per row of a chunk
        return ClientUpdate(state, WeightedUpload(per_row(weight) * params, weight), metrics)

    def server_step(self, server: FedAvgServerState, total: WeightedUpload | DeltaUpload, num_selected: int):
        if server.running is None:
            w, metrics = weighted_average(total, server.w)  # w = sum_i n_i theta_i / sum_i n_i (or uniform)
            return FedAvgServerState(w), metrics
        running, metrics = running_mean(server.running, total)  # u = (1/m) sum_i u_i over ALL m (fedapm.md 1.5)
        w = server.w.copy()
        w[self.shared] = running.w
        return FedAvgServerState(w, running), metrics

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.shared] if self.settings.shared_only else params

    def global_model(self, server: FedAvgServerState) -> Vector:
        return server.w

    def evaluated_model(self, state: ClientState, global_params: Vector) -> Vector | None:
        """`shared_start: local`: the client's own model (its shared part, the global personal part) is its PM."""
        if self.settings.shared_start == "broadcast" or not isinstance(state, SharedOnlyClientState):
            return None
        return self.start(state, global_params)
