"""AFL: agnostic federated learning, the model that minimizes the worst mixture of the clients' losses (Mohri,
Sivek and Suresh, "Agnostic Federated Learning", ICML 2019, arXiv:1902.00146, Algorithm 1).

The objective is min_w max_{lambda in the simplex} sum_k lambda_k F_k(w). The server keeps w and the mixture
weights lambda (uniform at start); each round a selected client k computes its training loss F_k(w) and full-batch
gradient grad F_k(w) at the received model (one gradient, the algorithm's stochastic gradient at full batch) and
uploads its share of the model's step, -gamma_w lambda_k grad F_k(w) (at the round's rate, so that `lr_decay`
decays it as every local rate), and its loss; the server takes the projected gradient steps of Algorithm 1,

    w      <- w - gamma_w (m / |S|) sum_{k in S} lambda_k grad F_k(w)              (descent on w)
    lambda <- Proj_simplex(lambda + gamma_lambda (m / |S|) sum_{k in S} F_k(w) e_k)   (ascent on lambda)

with m / |S| making both sums unbiased under uniform sampling (exact at full participation). gamma_w is `lr`,
gamma_lambda `lambda_lr`. The projection is onto the probability simplex (Duchi et al. 2008). The GM is w. The
losses reach the server as a vector with client k's at position k, so that the runtime's exact sum gives every
selected client's loss; what a client sends is counted as its gradient and one number. The uploads are no models,
so Byzantine attacks and robust rules do not apply (they are refused).
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
    payload_bytes,
    server_metrics,
)
from raysim.algorithms.requests import FullGradient, Vector, gradient
from raysim.algorithms.settings import LrSchedule


class AflSettings(LrSchedule):
    name: Literal["afl"] = "afl"
    lr: float = Field(0.1, gt=0, description="gamma_w: the step on the model")
    lambda_lr: float = Field(0.01, gt=0, description="gamma_lambda: the step on the mixture weights")


@dataclass
class AflBroadcast:
    w: Vector
    mixture: Vector
    """lambda: one weight per client, on the simplex."""


@dataclass
class AflUpload(Upload):
    step: Vector
    """-gamma_w lambda_k grad F_k(w)."""
    losses: Vector
    """F_k(w) at position k, zero elsewhere."""


@dataclass
class AflClientState:
    """An AFL client keeps nothing between rounds."""


@dataclass
class AflServerState:
    w: Vector
    mixture: Vector


def project_to_simplex(values: np.ndarray) -> np.ndarray:
    """The Euclidean projection onto {x >= 0, sum x = 1} (Duchi, Shalev-Shwartz, Singer and Chandra 2008)."""
    ordered = np.sort(values)[::-1]
    cumulative = np.cumsum(ordered) - 1.0
    index = np.arange(1, len(values) + 1)
    rho = np.nonzero(ordered - cumulative / index > 0)[0][-1]
    return np.maximum(values - cumulative[rho] / (rho + 1), 0.0)


@ALGORITHMS.register()
class Afl(Algorithm[AflSettings, AflClientState, AflServerState, AflBroadcast, AflUpload]):
    """A minimax of the clients' losses: gradient descent on the model, projected ascent on their mixture."""

    name = "afl"
    Settings = AflSettings
    Upload = AflUpload

    def init_server(self, init_params: Vector, num_clients: int) -> AflServerState:
        return AflServerState(init_params.copy(), np.full(num_clients, 1.0 / num_clients))

    def init_client(self, client: ClientInfo, init_params: Vector) -> AflClientState:
        return AflClientState()

    def broadcast(self, server: AflServerState) -> AflBroadcast:
        return AflBroadcast(server.w, server.mixture)

    def client_step(self, client: ClientInfo, state: AflClientState, received: AflBroadcast) -> ClientStep:
        at_w = yield from gradient(FullGradient(received.w, "train"))
        losses = np.zeros(len(received.mixture))
        losses[client.id] = at_w.loss
        weighted = -self.settings.lr * received.mixture[client.id] * np.asarray(at_w.grad, np.float64)
        metrics = {"train_loss": float(at_w.loss), "mixture_weight": float(received.mixture[client.id])}
        return ClientUpdate(state, AflUpload(weighted, losses), metrics)

    def server_step(self, server: AflServerState, total: AflUpload, num_selected: int):
        s, scale = self.settings, len(server.mixture) / num_selected
        w = (server.w + scale * total.step).astype(np.float32)
        mixture = project_to_simplex(server.mixture + s.lambda_lr * scale * total.losses)
        metrics = {**server_metrics(w, server.w), "mixture_max": float(mixture.max())}
        return AflServerState(w, mixture), metrics

    def global_model(self, server: AflServerState) -> Vector:
        return server.w

    def uplink_bytes(self, upload: AflUpload) -> int:
        """The gradient and the client's one loss (the vector form only serves the exact sum)."""
        return payload_bytes(upload.step) + 4

    def downlink_bytes(self, broadcast: AflBroadcast) -> int:
        """The model and the client's own mixture weight."""
        return payload_bytes(broadcast.w) + 4
