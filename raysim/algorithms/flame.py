"""FLAME: personalized FL with the Moreau envelope, solved by inexact multi-block ADMM (flame.md 1).

Client i keeps theta_i (personalized model), w_i (local model) and pi_i (dual). A selected client runs

    theta_i <- H epochs of SGD on f_i(theta) + lambda/2 ||theta - c||^2        (11), Alg. 1 line 12
    w_i     <- (lambda alpha_i theta_i + rho w - pi_i) / (lambda alpha_i + rho)  (12)
    pi_i    <- pi_i + rho (w_i - w)                                            (13)
    u_i     =  w_i + pi_i / rho

with prox centre c = w_i (paper) or the received w (authors' code). The server keeps the running sum
of the latest u_i of all m clients, so w = (1/m) sum_i u_i (14) needs only the selected clients'
changes u_i^new - u_i^old. Unselected clients keep all their state.

The client step is written with broadcasting and reductions over the last axis, so the same lines update one
client's vectors or a chunk's stacked rows (alpha_i then a column; `Algorithm.stacks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.base import (
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    SGDSettings,
    Upload,
    Vector,
)
from raysim.algorithms.servers import running_mean


class FlameSettings(SGDSettings):
    name: Literal["flame"] = "flame"
    lam: float = Field(1.0, gt=0, alias="lambda", description="lambda: Moreau-envelope regularization")
    rho: float = Field(0.1, gt=0, description="ADMM penalty")
    prox_center: Literal["local", "global"] = Field(
        "local", description="theta-step prox centre: w_i (paper, eq. 11) or the received w (authors' code)"
    )
    dual_updates: Literal["per_round", "per_epoch"] = Field(
        "per_round", description="w_i/pi_i once per round (Alg. 1) or after every local epoch (authors' code)"
    )


@dataclass
class FlameClientState:
    theta: Vector
    w: Vector
    pi: Vector

    def message(self, rho: float) -> Vector:
        """u_i = w_i + pi_i / rho, the vector the server averages."""
        return self.w + self.pi / rho


@dataclass
class FlameServerState:
    w: Vector
    sum_u: np.ndarray
    """float64 running sum over all m clients of their latest u_i."""
    num_clients: int


@dataclass
class FlameUpload(Upload):
    delta_u: Vector

    message_field = "delta_u"
    delta = True


class Flame(Algorithm[FlameSettings, FlameClientState, FlameServerState, Vector, FlameUpload]):
    name = "flame"
    Settings = FlameSettings
    Upload = FlameUpload
    stacks = True

    def init_server(self, init_params: Vector, num_clients: int) -> FlameServerState:
        # theta_i^0 = w_i^0 = w^0 and pi_i^0 = 0 (authors' code), so every u_i^0 = w^0.
        return FlameServerState(init_params.copy(), num_clients * init_params.astype(np.float64), num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FlameClientState:
        # pi^0 = lambda alpha_i (theta^0 - w^0) = 0, the initialization Lemma 3 requires (eq. 33). theta and w
        # share the host's read-only initial vector until the first step replaces them (steps never write into
        # a state's vectors), so thousands of clients cost nothing before they train.
        return FlameClientState(init_params, init_params, np.zeros(init_params.shape, init_params.dtype))

    def broadcast(self, server: FlameServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo | ClientChunk, state: FlameClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        w = broadcast
        lam_alpha = s.lam * client.weight
        theta, w_i, pi = state.theta, state.w, state.pi
        passes = [s.epochs] if s.dual_updates == "per_round" else [1] * s.epochs
        losses = []
        for epochs in passes:
            center = w_i if s.prox_center == "local" else w
            result = yield s.local_sgd(theta, epochs, prox_weight=s.lam, prox_center=center)
            losses.append(result.mean_loss)  # a number, or one per row
            theta = result.params
            w_i = (lam_alpha * theta + s.rho * w - pi) / (lam_alpha + s.rho)  # (12)
            pi = pi + s.rho * (w_i - w)  # (13)
        f32 = np.float32
        new = FlameClientState(theta.astype(f32, copy=False), w_i.astype(f32, copy=False), pi.astype(f32, copy=False))
        metrics = {
            "train_loss": np.mean(losses, axis=0),
            "primal_residual": np.linalg.norm(new.w - w, axis=-1),
            "dual_change": np.linalg.norm(new.pi - state.pi, axis=-1),
            "lemma3_error": np.max(np.abs(new.pi - lam_alpha * (new.theta - new.w)), axis=-1, initial=0.0),
        }
        u = new.message(s.rho)
        return ClientUpdate(new, FlameUpload(u - state.message(s.rho)), metrics, message=u)

    def server_step(self, server: FlameServerState, total: FlameUpload, num_selected: int):
        mean = running_mean(server.sum_u, total, server.num_clients, server.w)  # (14): mean over ALL m clients
        return FlameServerState(mean.model, mean.running_sum, server.num_clients), mean.metrics

    def global_model(self, server: FlameServerState) -> Vector:
        return server.w

    def personalized_model(self, state: FlameClientState) -> Vector:
        return state.theta
