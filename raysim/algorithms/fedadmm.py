"""FedADMM: consensus ADMM over the full model, theta_i = w, solved inexactly by local SGD (flame.md 2.2).

FLAME's problem (9) with lambda -> inf forces theta_i = w_i and reduces to (19), min sum_i alpha_i f_i(theta_i)
s.t. theta_i = w. Implemented directly (not as FLAME with a huge lambda, whose theta-step would be stiff):

    theta_i <- H epochs of SGD on alpha_i f_i(theta) + <pi_i, theta - w> + rho/2 ||theta - w||^2
    pi_i    <- pi_i + rho (theta_i - w)
    u_i     =  theta_i + pi_i / rho,        w = (1/m) sum over all m clients of their latest u_i

The SGD objective is divided by alpha_i (same minimizer; FLAME's theta-step drops alpha_i the same way).
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
    SGDSettings,
    Vector,
    train,
)
from raysim.algorithms.servers import DeltaUpload, RunningMeanState, running_mean, start_running_mean


class FedAdmmSettings(SGDSettings):
    name: Literal["fedadmm"] = "fedadmm"
    rho: float = Field(0.1, gt=0, description="ADMM penalty")
    start: Literal["global", "local"] = Field(
        "global", description="local SGD starts from the received w (inexact ADMM) or warm from theta_i"
    )
    freeze_dual: bool = Field(
        False, description="keep pi_i = 0 (FedProx-like penalty method; with rho -> 0 it is FedAvg, flame.md 2.3)"
    )


@dataclass
class FedAdmmClientState:
    theta: Vector
    pi: Vector

    def message(self, rho: float) -> Vector:
        """u_i = theta_i + pi_i / rho."""
        return self.theta + self.pi / rho


@ALGORITHMS.register()
class FedAdmm(Algorithm[FedAdmmSettings, FedAdmmClientState, RunningMeanState, Vector, DeltaUpload]):
    name = "fedadmm"
    Settings = FedAdmmSettings
    Upload = DeltaUpload

    def init_server(self, init_params: Vector, num_clients: int) -> RunningMeanState:
        return start_running_mean(init_params, num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedAdmmClientState:
        return FedAdmmClientState(init_params.copy(), np.zeros_like(init_params))

    def broadcast(self, server: RunningMeanState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo, state: FedAdmmClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        w = broadcast
        start = w if s.start == "global" else state.theta
        result = yield from train(
            s.local_sgd(start, prox_weight=s.rho / client.weight, prox_center=w, linear=state.pi / client.weight)
        )
        theta = result.params
        pi = state.pi if s.freeze_dual else (state.pi + s.rho * (theta - w)).astype(np.float32)
        new = FedAdmmClientState(theta.astype(np.float32), pi)
        u = new.message(s.rho)
        metrics = {
            "train_loss": result.mean_loss,
            "primal_residual": float(np.linalg.norm(new.theta - w)),
            "dual_change": float(np.linalg.norm(new.pi - state.pi)),
        }
        return ClientUpdate(new, DeltaUpload(u - state.message(s.rho)), metrics, message=u)

    def server_step(self, server: RunningMeanState, total: DeltaUpload, num_selected: int):
        return running_mean(server, total)  # w = (1/m) sum_i u_i

    def global_model(self, server: RunningMeanState) -> Vector:
        return server.w
