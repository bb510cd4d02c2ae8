"""Ditto: a FedAvg-trained global model plus personal models pulled towards it (FLAME's Ditto baseline).

A selected client trains (a) its persistent personal model v_i by SGD on f_i(v) + lambda/2 ||v - w||^2 with w the
received global model; and (b) its copy of the global model by local SGD on f_i and uploads it, the server
averaging the selected copies (uniformly, alpha_i = 1/m).

The FLAME authors' code (zsk66/FLAME update.py) differs in two ways, each a switch: it never
resyncs the global copy to the received w (`global_resync: false`), and it moves the copy at the global learning
rate by plain cross-entropy steps (no weight decay, no prox term), each on one batch `random.choice` picks among
a fresh shuffle's batches (the smaller last one included), H such steps after each of the H local epochs of the
personal model, with a new optimizer (momentum buffer empty) every epoch (`global_steps: one_batch`: at their
H = 1, one plain SGD step on one random batch per round). With both, its GM averages copies that stay close to
each other; a full epoch on never-resynced copies makes them drift into per-client models whose average is near
chance under label skew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, weighted_average
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate, CodeDraws
from raysim.algorithms.requests import LocalSGD, Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Prox


class DittoSettings(SGDSettings):
    name: Literal["ditto"] = "ditto"
    lam: float = Field(1.0, ge=0, alias="lambda", description="lambda: pull of v_i towards the global model")
    global_resync: bool = Field(
        True, description="start the global-model copy from the received w (Ditto) or keep it local (FLAME's code)"
    )
    global_lr: float | None = Field(None, gt=0, description="learning rate of the global-model copy (default: lr)")
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr", "global_lr")
    global_steps: Literal["epoch", "one_batch"] = Field(
        "epoch",
        description="the global copy's local work per round: `epochs` passes of SGD as the personal model's (Ditto), "
        "or FLAME's code: per local epoch H steps on one random batch each (of a fresh shuffle's batches, the last "
        "smaller one included) with momentum from an empty buffer, no weight decay; at H = 1 one plain SGD step",
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


@ALGORITHMS.register()
class Ditto(Algorithm[DittoSettings, DittoClientState, DittoServerState, Vector, WeightedUpload]):
    name = "ditto"
    Settings = DittoSettings
    Upload = WeightedUpload

    def init_server(self, init_params: Vector, num_clients: int) -> DittoServerState:
        return DittoServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> DittoClientState:
        return DittoClientState(init_params.copy(), init_params.copy())

    def broadcast(self, server: DittoServerState) -> Vector:
        return server.w

    @classmethod
    def code_draws(cls, settings: DittoSettings) -> CodeDraws | None:
        """At H = 1 their update_weights makes a pass for the personal model, then one for the copy's step and
        its pick, in the order `client_step` requests them; at H > 1 it interleaves the copy's steps with the
        personal epochs, which the personal model's one request (momentum kept across epochs) cannot."""
        if settings.global_resync or settings.global_steps != "one_batch" or settings.epochs != 1:
            return None
        return CodeDraws(passes=2, picks=1)

    def client_step(self, client: ClientInfo, state: DittoClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        personal = yield from train(s.local_sgd(state.v, terms=(Prox(broadcast, s.lam),)))
        shared = broadcast if s.global_resync else state.w
        global_lr = s.lr if s.global_lr is None else s.global_lr
        if s.global_steps == "one_batch":
            losses = []
            for _epoch in range(s.epochs):  # a new optimizer per epoch: its H steps share one momentum buffer
                step = LocalSGD(shared, 1, global_lr, s.batch_size, momentum=s.momentum, random_batches=s.epochs)
                result = yield from train(step)
                shared = result.params
                losses.append(result.mean_loss)
            shared_loss = float(np.mean(np.array(losses)))
        else:
            result = yield from train(s.model_copy(update={"lr": global_lr}).local_sgd(shared))
            shared, shared_loss = result.params, float(result.mean_loss)
        new = DittoClientState(personal.params.astype(np.float32), shared.astype(np.float32))
        metrics = {
            "train_loss": shared_loss,
            "personal_train_loss": personal.mean_loss,
            "personal_gap": float(np.linalg.norm(new.v - broadcast)),
        }
        return ClientUpdate(new, WeightedUpload(new.w.astype(np.float64), 1.0), metrics)

    def server_step(self, server: DittoServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # uniform mean of the selected global-model copies
        return DittoServerState(w), metrics

    def global_model(self, server: DittoServerState) -> Vector:
        return server.w

    def personalized_model(self, state: DittoClientState) -> Vector:
        return state.v
