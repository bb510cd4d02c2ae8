"""Ditto: a FedAvg-trained global model plus personal models pulled towards it (flame.md 2.4).

A selected client trains (a) its copy of the global model by local SGD on f_i and uploads it, the server
averaging the selected copies (uniformly, alpha_i = 1/m); and (b) its persistent personal model v_i by SGD
on f_i(v) + lambda/2 ||v - w||^2 with w the received global model.

The FLAME authors' code (flame.md 2.4, 11) differs in two ways, each a switch: it never resyncs the global copy
to the received w (`global_resync: false`), and it moves the copy by ONE plain SGD step (no momentum, no weight
decay, no prox term; fresh optimizer every round) on ONE random mini-batch per round at the global learning rate
(`global_steps: one_batch`). With both, its GM averages copies that stay close to each other; a full epoch on
never-resynced copies makes them drift into per-client models whose average is near chance under label skew.
(At H > 1 their code takes H such steps per local epoch, H * H per round; `one_batch` takes one, their H = 1.)
"""

from __future__ import annotations

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
    LocalSGD,
    SGDSettings,
    Upload,
    Vector,
)
from raysim.algorithms.servers import weighted_average


class DittoSettings(SGDSettings):
    name: Literal["ditto"] = "ditto"
    lam: float = Field(1.0, ge=0, alias="lambda", description="lambda: pull of v_i towards the global model")
    global_resync: bool = Field(
        True, description="start the global-model copy from the received w (Ditto) or keep it local (FLAME's code)"
    )
    global_lr: float | None = Field(None, gt=0, description="learning rate of the global-model copy (default: lr)")
    global_steps: Literal["epoch", "one_batch"] = Field(
        "epoch",
        description="the global copy's local work per round: `epochs` passes of SGD as the personal model's (Ditto), "
        "or one plain SGD step on one random mini-batch (FLAME's code)",
    )


@dataclass
class DittoClientState:
    v: Vector
    """Personal model v_i."""
    w: Vector
    """The client's copy of the global model after its last local training."""


@dataclass
class DittoServerState:
    w: Vector


@dataclass
class DittoUpload(Upload):
    params: Vector
    weight: float

    message_field = "params"
    weight_field = "weight"


@ALGORITHMS.register()
class Ditto(Algorithm[DittoSettings, DittoClientState, DittoServerState, Vector, DittoUpload]):
    name = "ditto"
    Settings = DittoSettings
    Upload = DittoUpload

    def init_server(self, init_params: Vector, num_clients: int) -> DittoServerState:
        return DittoServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> DittoClientState:
        return DittoClientState(init_params.copy(), init_params.copy())

    def broadcast(self, server: DittoServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo, state: DittoClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        start = broadcast if s.global_resync else state.w
        global_lr = s.lr if s.global_lr is None else s.global_lr
        if s.global_steps == "one_batch":
            shared = yield LocalSGD(start=start, epochs=1, lr=global_lr, batch_size=s.batch_size, max_steps=1)
        else:
            shared = yield s.model_copy(update={"lr": global_lr}).local_sgd(start)
        personal = yield s.local_sgd(state.v, prox_weight=s.lam, prox_center=broadcast)
        new = DittoClientState(personal.params.astype(np.float32), shared.params.astype(np.float32))
        metrics = {
            "train_loss": shared.mean_loss,
            "personal_train_loss": personal.mean_loss,
            "personal_gap": float(np.linalg.norm(new.v - broadcast)),
        }
        return ClientUpdate(new, DittoUpload(new.w.astype(np.float64), 1.0), metrics)

    def server_step(self, server: DittoServerState, total: DittoUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # uniform mean of the selected global-model copies
        return DittoServerState(w), metrics

    def global_model(self, server: DittoServerState) -> Vector:
        return server.w

    def personalized_model(self, state: DittoClientState) -> Vector:
        return state.v
