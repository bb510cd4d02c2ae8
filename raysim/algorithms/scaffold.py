"""SCAFFOLD: local SGD corrected by control variates against client drift (Karimireddy, Kale, Mohri, Reddi,
Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020, arXiv:1910.06378).

FedSLR's Table 1 global baseline with the Option II control-variate update (FedSLR, App. B.2). The server holds
the global model x and the server control variate c, every client its control variate c_i (zeros at first). A
selected client, given (x, c), runs Algorithm 1 of the paper:

    y_i  <- x;  K times:  y_i <- y_i - eta_l (g_i(y_i) - c_i + c)                       (Alg. 1 line 10)
    c_i+ <- c_i - c + (x - y_i) / (K eta_l)                                             (line 12, Option II)
    uploads (Delta y_i, Delta c_i) = (y_i - x, c_i+ - c_i);  c_i <- c_i+                 (lines 13-14)

and the server, over the selected set S of the N clients,

    x <- x + eta_g (1/|S|) sum_S Delta y_i,   c <- c + (|S|/N) (1/|S|) sum_S Delta c_i   (lines 16-17)

The correction is LocalSGD's `linear` term c - c_i (its gradient adds to g_i at every step); K is the number of
steps the local training took (SGDResult.steps, epochs x batches). A client uploads its model y_i (weight 1) rather
than y_i - x, the same mean and a message that attacks and robust aggregation read as FedAvg's; and Delta c_i. Both
directions carry two model-sized vectors (FedSLR, Table 2: "SCAFFOLD doubles this"). With zero control variates
(round 0) and eta_g = 1 a round is FedAvg's with uniform aggregation. The step stacks (per_row, as FedAvg's). Option II
reads (x - y_i) / (K eta_l) as the mean corrected gradient of plain SGD: with momentum it is not (keep momentum 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
    per_row,
    server_metrics,
)
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Linear
from raysim.jit import distances


class ScaffoldSettings(SGDSettings):
    name: Literal["scaffold"] = "scaffold"
    eta_g: float = Field(1.0, gt=0, description="eta_g: server learning rate on the mean model change (Alg. 1 line 16)")


@dataclass
class ScaffoldClientState:
    c: Vector
    """c_i, the client control variate (float32; zeros before the client's first round)."""


@dataclass
class ScaffoldServerState:
    w: Vector
    """The global model, the paper's x."""
    c: np.ndarray
    """float64 server control variate c = (1/N) sum_i c_i (it starts at zero with every c_i)."""
    num_clients: int


@dataclass(frozen=True, eq=False)
class ScaffoldBroadcast:
    x: Vector
    c: Vector
    """The server control variate as float32."""


@dataclass
class ScaffoldUpload(Upload):
    y: Vector
    """The local model y_i (times `count`)."""
    count: float | np.ndarray
    """1 per client, so that the summed y_i divided by the summed count is their mean."""
    delta_c: Vector
    """c_i+ - c_i."""

    message_field = "y"
    weight_field = "count"


@ALGORITHMS.register()
class Scaffold(
    Algorithm[ScaffoldSettings, ScaffoldClientState, ScaffoldServerState, ScaffoldBroadcast, ScaffoldUpload]
):
    name = "scaffold"
    Settings = ScaffoldSettings
    Upload = ScaffoldUpload
    stacks = True

    def init_server(self, init_params: Vector, num_clients: int) -> ScaffoldServerState:
        return ScaffoldServerState(init_params.copy(), np.zeros(init_params.shape, np.float64), num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> ScaffoldClientState:
        return ScaffoldClientState(np.zeros_like(init_params))

    def broadcast(self, server: ScaffoldServerState) -> ScaffoldBroadcast:
        return ScaffoldBroadcast(server.w, server.c.astype(np.float32))

    def client_step(
        self, client: ClientInfo | ClientChunk, state: ScaffoldClientState, broadcast: ScaffoldBroadcast
    ) -> ClientStep:
        s = self.settings
        x, c = broadcast.x, broadcast.c
        result = yield from train(s.local_sgd(x, terms=(Linear(c - state.c),)))  # line 10: g_i(y) - c_i + c
        y = np.asarray(result.params, np.float32)
        steps = per_row(result.steps)
        # Option II (line 12): c_i+ = c_i - c + (x - y_i) / (K eta_l)
        new_c = (state.c - c + (x - y) / (steps * np.float32(s.lr))).astype(np.float32)
        delta_c = new_c - state.c
        count = np.ones_like(np.asarray(client.num_train, np.float32))  # a number, or one per row of a chunk
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": distances(y, x),
            "control_norm": np.linalg.norm(new_c, axis=-1),
        }
        return ClientUpdate(ScaffoldClientState(new_c), ScaffoldUpload(per_row(count) * y, count, delta_c), metrics)

    def server_step(self, server: ScaffoldServerState, total: ScaffoldUpload, num_selected: int):
        x = server.w.astype(np.float64)
        mean_y = np.asarray(total.y, np.float64) / np.asarray(total.count, np.float64)
        new_x = (x + self.settings.eta_g * (mean_y - x)).astype(np.float32)  # line 16
        new_c = server.c + np.asarray(total.delta_c, np.float64) / server.num_clients  # line 17: (|S|/N) mean
        metrics = server_metrics(new_x, server.w) | {"control_norm": float(np.linalg.norm(new_c))}
        return ScaffoldServerState(new_x, new_c, server.num_clients), metrics

    def global_model(self, server: ScaffoldServerState) -> Vector:
        return server.w
