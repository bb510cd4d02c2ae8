"""The averaging family: a server that takes the weighted mean of what this round's clients upload.

Weighted-average servers (`weight_field` set: FedAvg (FLAME, Sec. IV-E), FedProx, Ditto, FedAlt and
FedSim (FedAPM, Sec. 6.1)). The global model is the weighted mean of this round's selected clients' messages:

    w = sum_{i in S} a_i x_i / sum_{i in S} a_i

Each client uploads a_i * x_i and a_i (`WeightedUpload`); the runtime sums both exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.consensus import DeltaUpload, RunningMeanState, running_mean, start_running_mean
from raysim.algorithms.families.server_optimizers import (
    ServerOptimizerSettings,
    ServerOptimizerState,
    server_optimizer_step,
    start_server_optimizer,
)
from raysim.algorithms.families.split import (
    SplitSettings,
    change_and_deviation,
    deviation,
    personal_mask,
    shared_segments,
)
from raysim.algorithms.interface import (
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
    per_row,
    server_metrics,
)
from raysim.algorithms.requests import LocalSGD, Number, Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.jit import distances
from raysim.models.spec import ParamSpec


@dataclass
class WeightedUpload(Upload):
    """An averaging client's upload: its message times its weight, a_i x_i, and a_i."""

    weighted: Vector
    weight: Number

    message_field = "weighted"
    weight_field = "weight"


def upload_weight(num_train: Number, aggregation: str) -> np.ndarray:
    """A client's weight in a WeightedUpload (float32; one per row of a chunk): its training-set size n_i with
    `aggregation: samples` (McMahan et al.), else 1."""
    samples = np.asarray(num_train, np.float32)
    return samples if aggregation == "samples" else np.ones_like(samples)


def weighted_average(total: Upload, previous: Vector) -> tuple[Vector, dict[str, float]]:
    """sum(weight * message) / sum(weight) over the selected clients (float32), and the server metrics.

    `previous` is the current global model (for `global_change`)."""
    if total.delta or total.message_field is None or total.weight_field is None:
        kind = type(total).__name__
        raise TypeError(f"weighted_average needs an Upload with message_field and weight_field, got {kind}")
    model = (getattr(total, total.message_field) / getattr(total, total.weight_field)).astype(np.float32)
    return model, server_metrics(model, previous)


class AveragingSettings(SGDSettings, SplitSettings):
    """FedAvg's settings, which every method of the family extends."""

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

    server_optimizer: ServerOptimizerSettings = Field(
        default_factory=ServerOptimizerSettings,
        description="the server's step from the round's mean: none (the mean), momentum (FedAvgM), adagrad, adam, "
        "yogi (FedOpt, Reddi et al. 2021), with its lr, beta1, beta2 and tau",
    )

    @model_validator(mode="after")
    def _check_shared_start(self) -> AveragingSettings:
        if self.shared_start == "local" and not self.shared_only:
            raise ValueError(
                "algorithm.shared_start='local' is the authors' code's shared-only path: set algorithm.shared_only=true"
            )
        if self.shared_only and self.server_optimizer.kind != "none":
            raise ValueError(
                "algorithm.server_optimizer applies to the mean of the selected clients; algorithm.shared_only keeps "
                "the mean of all clients' latest shared parts: set server_optimizer.kind=none or shared_only=false"
            )
        return self


@dataclass
class AveragingClientState:
    """A FedAvg-like client keeps nothing between rounds."""


@dataclass
class SharedOnlyClientState:
    """`shared_only`: the client's latest shared part, the model the authors' server keeps for it."""

    shared: Vector


@dataclass
class AveragingServerState:
    w: Vector
    running: RunningMeanState | None = None
    """`shared_only`: the mean over all m clients of their latest shared parts (w's shared part), and their sum."""
    optimizer: ServerOptimizerState | None = None
    """The server optimizer's moments (`server_optimizer`), None for the plain mean."""


ClientState = AveragingClientState | SharedOnlyClientState


class Averaging(Algorithm[AveragingSettings, ClientState, AveragingServerState, Vector, WeightedUpload | DeltaUpload]):
    """FedAvg's client and server steps (FLAME, Sec. IV-E), with the FedAPM authors' shared-only path: the base of the
    methods that change only the local objective (FedProx) or the server's mean (FedALA, FedLP); a subclass
    registers itself with its `name` and `Settings`."""

    Upload = WeightedUpload
    """A DeltaUpload of the shared part with `shared_only`."""
    stacks = True
    scales_loss = True

    def __init__(self, settings: AveragingSettings, params: ParamSpec):
        super().__init__(settings, params)
        # The whole model is shared where a preset leaves a part empty (FedAvg has no personal part of its own);
        # explicit patterns and the shared-only training need a real split.
        personal = personal_mask(settings, params, allow_empty=settings.personal is None and not settings.shared_only)
        self.shared = ~personal if personal.any() and not personal.all() else np.ones_like(personal)
        self.segments = shared_segments(params, self.shared, whole=True)
        """The shared tensors' ranges in the model vector, which every client step's deviation reads."""

    def init_server(self, init_params: Vector, num_clients: int) -> AveragingServerState:
        if not self.settings.shared_only:
            optimizer = start_server_optimizer(self.settings.server_optimizer, init_params)
            return AveragingServerState(init_params.copy(), optimizer=optimizer)
        return AveragingServerState(init_params.copy(), start_running_mean(init_params[self.shared], num_clients))

    def init_client(self, client: ClientInfo, init_params: Vector) -> ClientState:
        if self.settings.shared_only:
            return SharedOnlyClientState(init_params[self.shared])
        return AveragingClientState()

    def broadcast(self, server: AveragingServerState) -> Vector:
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
        # The deviation is from the server's model even where the client starts from its own (the authors' measure)
        if start is broadcast:  # both norms in one call, each row read once
            update_norm, per_tensor, l2 = change_and_deviation(params, broadcast, self.segments)
        else:
            update_norm = distances(params, start)
            per_tensor, l2 = deviation(self.params, self.shared, params, broadcast, whole=True, segments=self.segments)
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": update_norm,
            "deviation": per_tensor,
            "deviation_l2": l2,
        }
        if isinstance(state, SharedOnlyClientState):  # the change of the latest shared part (families/consensus.py)
            shared = params[..., self.shared]
            change = shared.astype(np.float64) - state.shared
            return ClientUpdate(SharedOnlyClientState(shared), DeltaUpload(change), metrics)
        weight = upload_weight(client.num_train, self.settings.aggregation)  # a number, or one per row of a chunk
        return ClientUpdate(state, WeightedUpload(per_row(weight) * params, weight), metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """With `shared_only`, the client's latest shared part (it uploads its change); else the local model."""
        if isinstance(update.state, SharedOnlyClientState):
            return update.state.shared.astype(np.float64)
        return super().message(update)

    def server_step(self, server: AveragingServerState, total: WeightedUpload | DeltaUpload, num_selected: int):
        if server.running is None:
            return self.averaged(server, total)
        running, metrics = running_mean(server.running, total)  # u = (1/m) sum_i u_i over ALL m (the authors' code)
        w = server.w.copy()
        w[self.shared] = running.w
        return AveragingServerState(w, running), metrics

    def averaged(
        self, server: AveragingServerState, total: WeightedUpload | DeltaUpload
    ) -> tuple[AveragingServerState, dict]:
        """The server state after this round's weighted mean, w = sum_i a_i theta_i / sum_i a_i (a_i = n_i or 1),
        taken through the server optimizer (families/server_optimizers.py; `none`: the mean itself)."""
        mean, metrics = weighted_average(total, server.w)
        optimizer = self.settings.server_optimizer
        statistics = self.params.statistics_mask() if self.params.statistics else None
        w, moments = server_optimizer_step(optimizer, server.optimizer, server.w, mean, statistics)
        if moments is not None:
            metrics = server_metrics(w, server.w)
        return AveragingServerState(w, optimizer=moments), metrics

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.shared] if self.settings.shared_only else params

    def global_model(self, server: AveragingServerState) -> Vector:
        return server.w

    def evaluated_model(self, state: ClientState, global_params: Vector) -> Vector | None:
        """`shared_start: local`: the client's own model (its shared part, the global personal part) is its PM."""
        if self.settings.shared_start == "broadcast" or not isinstance(state, SharedOnlyClientState):
            return None
        return self.start(state, global_params)
