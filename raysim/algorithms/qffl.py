"""q-FFL as q-FedAvg: fair resource allocation, the clients with higher loss weigh more (Li, Sanjabi, Beirami and
Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020, arXiv:1905.10497, Algorithm 2).

The objective is min_w sum_k p_k F_k^{q+1}(w) / (q + 1): q = 0 is FedAvg's, larger q pulls towards the worst-off
clients. A selected client k computes its training loss F_k(w^t) at the received model, runs `epochs` epochs of
local SGD to wbar_k, and with L = 1/lr (the paper's Lipschitz estimate, Sec. 4.2) sends

    Delta_k = F_k^q(w^t) L (w^t - wbar_k),    h_k = q F_k^{q-1}(w^t) ||L (w^t - wbar_k)||^2 + L F_k^q(w^t);

the server moves w^{t+1} = w^t - sum_k Delta_k / sum_k h_k (Algorithm 2, line 10). With q = 0 this is the uniform
mean of the local models (tests check it). Both sums are exact (the runtime's), so the step does not depend on how
clients fall on hosts. Communication: the model down, Delta_k and h_k up. The uploads are no models, so Byzantine
attacks and robust rules, which replace a model, do not apply (they are refused). Default q = 1 (the paper tunes q
per dataset from 0.001 to 15).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import FullGradient, Number, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings


class QfflSettings(SGDSettings):
    name: Literal["qffl"] = "qffl"
    q: float = Field(1.0, ge=0, description="q: the fairness exponent (0: FedAvg's objective; the paper's 0.001-15)")


@dataclass
class QfflUpload(Upload):
    """Delta_k (`step`) and h_k (Algorithm 2)."""

    step: Vector
    h: Number


@dataclass
class QfflClientState:
    """A q-FFL client keeps nothing between rounds."""


@dataclass
class QfflServerState:
    w: Vector


@ALGORITHMS.register()
class Qffl(Algorithm[QfflSettings, QfflClientState, QfflServerState, Vector, QfflUpload]):
    """q-FedAvg: local SGD, then the server's step weighted by the clients' losses to the power q."""

    name = "qffl"
    Settings = QfflSettings
    Upload = QfflUpload

    def init_server(self, init_params: Vector, num_clients: int) -> QfflServerState:
        return QfflServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> QfflClientState:
        return QfflClientState()

    def broadcast(self, server: QfflServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo, state: QfflClientState, w: Vector) -> ClientStep:
        s = self.settings
        result = yield from train(s.local_sgd(w))  # first, as FedAvg's: the same batches (q = 0 is FedAvg)
        at_w = yield from gradient(FullGradient(w, "train"))
        lipschitz = 1.0 / s.lr
        change = lipschitz * (np.asarray(w, np.float64) - np.asarray(result.params, np.float64))
        loss = max(float(at_w.loss), 1e-10)  # F_k > 0 for a cross-entropy; guards loss**(q - 1) at q < 1
        h = s.q * loss ** (s.q - 1) * float(change @ change) + lipschitz * loss**s.q
        metrics = {"train_loss": result.mean_loss, "loss_at_global": float(at_w.loss), "h": h}
        return ClientUpdate(state, QfflUpload(loss**s.q * change, h), metrics)

    def server_step(self, server: QfflServerState, total: QfflUpload, num_selected: int):
        w = (server.w - total.step / total.h).astype(np.float32)  # Algorithm 2, line 10
        return QfflServerState(w), server_metrics(w, server.w)

    def global_model(self, server: QfflServerState) -> Vector:
        return server.w
