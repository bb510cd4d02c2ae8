"""FedDyn: federated learning with dynamic regularization (Acar, Zhao, Matas, Mattina, Whatmough, Saligrama,
"Federated Learning Based on Dynamic Regularization", ICLR 2021, arXiv:2111.04263).

FedSLR's Table 1 global baseline with penalty alpha = 0.1 (FedSLR, App. B.2). A selected client k, given the server
model theta^{t-1}, solves (inexactly, by local SGD from theta^{t-1}) and updates its gradient state (Alg. 1):

    theta_k^t = argmin_theta L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta^{t-1}||^2  (line 6)
    grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})                             (line 7)

and the server, over the selected set P_t of the m clients,

    h^t = h^{t-1} - alpha (1/m) sum_{P_t} (theta_k^t - theta^{t-1}),
    theta^t = (1/|P_t|) sum_{P_t} theta_k^t - h^t / alpha                                          (lines 9-10)

This is FedSLR's Phase I and dual update with alpha = 1/eta_g (gamma_k = grad L_k(theta_k), FedSLR, eq. (4); eq. (5))
and its server before the nuclear prox with h = the mean of all m duals (Alg. 3's partial-participation form,
FedSLR, Alg. 3, App. A.5): the functions below are that one implementation, and raysim.algorithms.fedslr uses them. The
local rate decays as FedSLR's, eta_l 0.998^t (FedSLR, App. B). At a fixed point (every theta_k = theta) the gradient
states sum to zero, so on convex L_k the server model is the minimizer of sum_k L_k (the paper's Section 3).

As alpha -> 0 the client step is FedAvg's local SGD (the linear and proximal terms vanish), but the global model is
not FedAvg's: h^t / alpha = -(1/m) sum over rounds of sum_{P_t} (theta_k - theta) does not depend on alpha, so the
server keeps adding the accumulated mean change (tests/unit/test_feddyn.py checks both). The step stacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload
from raysim.algorithms.families.dynamic import (
    DynamicSolverSettings,
    dual_corrected_mean,
    dual_update,
    dynamic_request,
    mirrored_dual_mean,
)
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
    server_metrics,
)
from raysim.algorithms.requests import Vector, train
from raysim.jit import distances


class FedDynSettings(DynamicSolverSettings):
    name: Literal["feddyn"] = "feddyn"
    alpha: float = Field(0.1, gt=0, description="alpha: dynamic-regularization weight (0.1 in FedSLR's Table 1)")

    @property
    def eta_g(self) -> float:
        """1/alpha, FedSLR's name for the same step (the shared functions take it)."""
        return 1.0 / self.alpha


@dataclass
class FedDynClientState:
    gamma: Vector
    """grad L_k(theta_k), the client's gradient state (zeros before its first round)."""


@dataclass
class FedDynServerState:
    w: Vector
    """theta^t, the server model."""
    h: np.ndarray
    """float64: h^t, the mean over all m clients of their gradient states."""
    num_clients: int


@ALGORITHMS.register()
class FedDyn(Algorithm[FedDynSettings, FedDynClientState, FedDynServerState, Vector, WeightedUpload]):
    name = "feddyn"
    Settings = FedDynSettings
    Upload = WeightedUpload
    stacks = True

    def init_server(self, init_params: Vector, num_clients: int) -> FedDynServerState:
        return FedDynServerState(init_params.copy(), np.zeros(init_params.shape, np.float64), num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedDynClientState:
        return FedDynClientState(np.zeros_like(init_params))

    def broadcast(self, server: FedDynServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo | ClientChunk, state: FedDynClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        w_t = broadcast
        lr = s.lr  # eta_l^(t): the runtime steps round t with its settings (LrSchedule.at_round)
        result = yield from train(dynamic_request(s, w_t, state.gamma, s.eta_g, lr))  # line 6
        w_i = np.asarray(result.params, np.float32)
        gamma = dual_update(state.gamma, w_t, w_i, s.eta_g)  # line 7
        count = np.ones_like(np.asarray(client.num_train, np.float32))  # a number, or one per row of a chunk
        metrics = {"train_loss": result.mean_loss, "update_norm": distances(w_i, w_t), "lr": lr}
        return ClientUpdate(FedDynClientState(gamma), WeightedUpload(per_row(count) * w_i, count), metrics)

    def server_step(self, server: FedDynServerState, total: WeightedUpload, num_selected: int):
        eta_g = self.settings.eta_g
        summed = np.asarray(total.weighted, np.float64)
        h = mirrored_dual_mean(server.h, server.w, summed, num_selected, eta_g, server.num_clients)  # line 9
        w = dual_corrected_mean(summed, float(total.weight), h, eta_g).astype(np.float32)  # line 10
        metrics = server_metrics(w, server.w) | {"h_norm": float(np.linalg.norm(h))}
        return FedDynServerState(w, h, server.num_clients), metrics

    def downlink_bytes(self, broadcast: Vector) -> int:
        """The model plus the round t (the clients' rate decay, FedSLR, App. B), as float32, as FedSLR counts it."""
        return 4 * (broadcast.size + 1)

    def global_model(self, server: FedDynServerState) -> Vector:
        return server.w
