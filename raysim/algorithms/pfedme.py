"""pFedMe: the Moreau-envelope problem (6) by a penalty method, FLAME's Lagrangian with pi_i = 0 (FLAME, Sec. IV-E).

Each round a selected client resets its local model w_i to the received w; per local epoch its persistent
personalized model theta_i takes SGD steps on f_i(theta) + lambda/2 ||theta - w_i||^2 and then w_i takes a
gradient step w_i <- w_i - eta_2 lambda (w_i - theta_i). The server (authors' code, as run in FLAME's
experiments) sets w to the mean of the latest w_i of all m clients; `aggregation: selected` gives the original
pFedMe server w <- (1 - beta) w + beta mean_{i in S} w_i.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.consensus import DeltaUpload, RunningMeanState, running_mean, start_running_mean
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    CodeDraws,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Prox


class PFedMeSettings(SGDSettings):
    name: Literal["pfedme"] = "pfedme"
    lam: float = Field(1.0, gt=0, alias="lambda", description="lambda: Moreau-envelope regularization")
    global_lr: float = Field(0.1, gt=0, description="eta_2: step of the w_i gradient update (code default 0.1)")
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr", "global_lr")
    aggregation: Literal["all", "selected"] = Field(
        "all", description="w = mean of all m clients' latest w_i (FLAME's code) or the beta-mix over S^t (pFedMe)"
    )
    beta: float = Field(1.0, gt=0, le=2, description="server mixing beta (aggregation: selected only)")

    @model_validator(mode="after")
    def _check_random_epochs(self) -> PFedMeSettings:
        """Each of pFedMe's epochs is a local training of its own (a w_i step follows it): no passes to draw."""
        if self.random_epochs:
            raise ValueError(
                "algorithm.random_epochs: pfedme trains one epoch at a time (a w_i step after each); "
                "set algorithm.random_epochs: false"
            )
        return self


@dataclass
class PFedMeClientState:
    theta: Vector
    w: Vector
    """The client's latest local model w_i (what the server averages)."""


@dataclass
class PFedMeUpload(Upload):
    """aggregation: selected: the client's new local model w_i, averaged over the selected clients (aggregation:
    all uploads its change, a DeltaUpload)."""

    w: Vector

    message_field = "w"


@ALGORITHMS.register()
class PFedMe(Algorithm[PFedMeSettings, PFedMeClientState, RunningMeanState, Vector, PFedMeUpload | DeltaUpload]):
    name = "pfedme"
    Settings = PFedMeSettings
    Upload = PFedMeUpload

    @classmethod
    def code_draws(cls, settings: PFedMeSettings) -> CodeDraws:
        """One pass per local epoch (their update_weights' loop over the trainloader)."""
        return CodeDraws(passes=settings.epochs)

    def init_server(self, init_params: Vector, num_clients: int) -> RunningMeanState:
        """The running sum of the latest w_i serves aggregation: all; aggregation: selected keeps only w."""
        return start_running_mean(init_params, num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> PFedMeClientState:
        return PFedMeClientState(init_params.copy(), init_params.copy())

    def broadcast(self, server: RunningMeanState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo, state: PFedMeClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        theta, w_i = state.theta, broadcast.astype(np.float64)
        losses = []
        for _epoch in range(s.epochs):
            result = yield from train(s.local_sgd(theta, 1, terms=(Prox(w_i.astype(np.float32), s.lam),)))
            losses.append(result.mean_loss)
            theta = result.params
            w_i = w_i - s.global_lr * s.lam * (w_i - theta)
        new = PFedMeClientState(theta.astype(np.float32), w_i.astype(np.float32))
        upload = DeltaUpload(new.w - state.w) if s.aggregation == "all" else PFedMeUpload(new.w)
        train_loss, gap = float(np.mean(np.array(losses))), float(np.linalg.norm(new.theta - new.w))
        metrics = {"train_loss": train_loss, "local_gap": gap}
        return ClientUpdate(new, upload, metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """w_i of the new state, what the server averages."""
        return update.state.w.astype(np.float64)

    def server_step(self, server: RunningMeanState, total: PFedMeUpload | DeltaUpload, num_selected: int):
        if isinstance(total, DeltaUpload):  # aggregation "all": w = (1/m) sum_i w_i over all m clients
            return running_mean(server, total)
        beta = self.settings.beta
        w = ((1 - beta) * server.w + beta * total.w / num_selected).astype(np.float32)
        return dataclasses.replace(server, w=w), server_metrics(w, server.w)

    def global_model(self, server: RunningMeanState) -> Vector:
        return server.w

    def personalized_model(self, state: PFedMeClientState) -> Vector:
        return state.theta
