"""FedRep: a shared body, a personal head per client, trained head first (Collins et al., ICML 2021).

Collins, Hassani, Mokhtari, Shakkottai, arXiv:2102.07078; FedSLR's baseline (fedslr.md 6.4: conv layers shared, the
last linear layer personal).

A selected client i, given the global body phi, runs (Algorithm 1 of Collins et al.)

    h_i   <- tau_h epochs of SGD over h on f_i(phi, h), the body frozen            (head update)
    phi_i <- tau_phi epochs of SGD over phi on f_i(phi, h_i), the new head frozen    (representation update)

and uploads phi_i only; the server averages the selected clients' bodies, phi <- (1/|S|) sum_{i in S} phi_i
(`aggregation: samples` weights them by n_i instead). The head never leaves the client: its uplink and downlink
are the body alone (fedslr.md 6.5: FedRep counts only its shared part). The GM is the global body with the common
initial head; each client's PM is the latest global body with its own head.

`phases: joint` is FedRep as the FedSLR authors' code runs it (huangtiansheng/fedslr utils_methods.py, train_FedRep):
head and body trained together for `epochs` epochs from the received body, the body averaged uniformly.

The head is `personal` (fnmatch patterns) or `preset` (raysim.algorithms.fedapm.personal_mask); an empty head
(`personal: []`) is FedAvg. The step is written over rows, so it stacks (vectorized hosts).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
from pydantic import Field

from raysim.algorithms.fedapm import SplitPreset, SplitSettings, personal_mask
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.requests import Number, Request, Result, SGDResult, Vector, train
from raysim.algorithms.servers import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.settings import SGDSettings
from raysim.errors import ConfigError
from raysim.models.spec import ParamSpec


class SharedPartSettings(SGDSettings):
    """Local SGD and the weights of the shared part's average (FedRep, LG-FedAvg)."""

    aggregation: Literal["uniform", "samples"] = Field(
        "uniform", description="weights of the shared part's average: equal (the papers; FedSLR's code) or n_i"
    )


class FedRepSettings(SharedPartSettings, SplitSettings):
    name: Literal["fedrep"] = "fedrep"
    preset: SplitPreset = Field(
        "last_layer",
        description="the personal head (fedapm.md 2 presets); last_layer: the final linear layer (fedslr.md 6.4)",
    )
    epochs: int = Field(1, ge=1, description="tau_phi: epochs on the body, head frozen (1 in Collins et al.)")
    head_epochs: int = Field(10, ge=0, description="tau_h: epochs on the head, body frozen (10 in Collins et al.)")
    phases: Literal["alternating", "joint"] = Field(
        "alternating",
        description="head then body (Collins et al., Algorithm 1), or head and body together for `epochs` epochs "
        "(the FedSLR authors' code; head_epochs unused)",
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


@ALGORITHMS.register()
class FedRep(SharedPartAlgorithm[FedRepSettings]):
    name = "fedrep"
    Settings = FedRepSettings

    def personal_part(self, params: ParamSpec) -> np.ndarray:
        """The head: may be empty (FedAvg), not the whole model (nothing would be shared)."""
        settings = self.settings
        head = personal_mask(settings, params, allow_empty=True)
        if head.all():
            patterns = settings.personal
            source = f"personal={list(patterns)}" if patterns is not None else f"preset={settings.preset!r}"
            raise ConfigError(
                f"algorithm.{source} makes the whole model the personal head: nothing is shared; parameters of this "
                f"model: {', '.join(params.names)}"
            )
        return head

    def local_training(
        self, start: Vector, num_clients: int
    ) -> Generator[Request, Result, tuple[SGDResult, dict[str, Number]]]:
        """Head then body (Algorithm 1), or both at once (`phases: joint`); an empty head trains the whole model."""
        s = self.settings
        if s.phases == "joint" or not self.personal.any():
            return (yield from train(s.scaled(s.local_sgd(start), num_clients))), {}
        metrics: dict[str, Number] = {}
        if s.head_epochs:
            head = yield from train(s.scaled(s.local_sgd(start, s.head_epochs, mask=self.personal), num_clients))
            start, metrics = head.params, {"head_train_loss": head.mean_loss}
        body = yield from train(s.scaled(s.local_sgd(start, mask=self.shared), num_clients))
        return body, metrics
