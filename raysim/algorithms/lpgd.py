"""LPGD: local proximal gradient descent, FedSLR's ablation with the nuclear prox inside every local step (Huang,
Shen, Sun, Lin, Tao, "Fusion of Global and Local Knowledge for Personalized Federated Learning", TMLR 2023,
Appendix A.2).

A selected client runs proximal SGD from the received model w_t,

    w_{i,t,k+1} = Prox_{eta_l lambda sum_l ||.||_*}( w_{i,t,k} - eta_l grad f_i(w_{i,t,k}; xi) )    (eq. 18)

(LocalSGD.nuclear: layer-wise SVT of the matrixized conv and linear weights at eta_l lambda after every step; 1-D
parameters unthresholded, as FedSLR's server prox), and the server averages the selected local models uniformly

    w_{t+1} = (1/|S_t|) sum_{S_t} w_{i,t,K}                                                        (eq. 19)

The local models are low-rank, their mean in general is not (A.2's drawback): the downlink is the dense model, and
the uplink is counted dense too, as sent here (A.2 notes a low-rank local model could be sent factored; the
`local_rank_fraction` metric says how much that would save). The local rate decays as FedSLR's (FedSLR, App. B).
With lambda = 0 it is FedAvg with uniform aggregation. The step is written over a chunk (it stacks), but the
vectorized trainer runs its requests one client at a time: an SVD per layer and step has no lockstep form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, weighted_average
from raysim.algorithms.families.dynamic import DynamicSolverSettings
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.prox import matrix_shape
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.terms import Nuclear
from raysim.jit import distances


class LpgdSettings(DynamicSolverSettings):
    name: Literal["lpgd"] = "lpgd"
    lam: float = Field(
        1e-4, ge=0, alias="lambda", description="lambda: nuclear-norm penalty; SVT at eta_l * lambda per local step"
    )


@dataclass
class LpgdClientState:
    """LPGD keeps nothing on the client between rounds."""


@dataclass
class LpgdServerState:
    w: Vector


@ALGORITHMS.register()
class Lpgd(Algorithm[LpgdSettings, LpgdClientState, LpgdServerState, Vector, WeightedUpload]):
    name = "lpgd"
    Settings = LpgdSettings
    Upload = WeightedUpload
    stacks = True

    def init_server(self, init_params: Vector, num_clients: int) -> LpgdServerState:
        return LpgdServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> LpgdClientState:
        return LpgdClientState()

    def broadcast(self, server: LpgdServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo | ClientChunk, state: LpgdClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        lr = s.lr  # eta_l * decay^t (LrSchedule.at_round)
        request = s.local_sgd(broadcast, terms=(Nuclear(s.lam),) if s.lam else ())
        result = yield from train(request)  # (18)
        w_i = np.asarray(result.params, np.float32)
        count = np.ones_like(np.asarray(client.num_train, np.float32))  # a number, or one per row of a chunk
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": distances(w_i, broadcast),
            "lr": lr,
            "local_rank_fraction": self.rank_fraction(w_i),
        }
        return ClientUpdate(state, WeightedUpload(per_row(count) * w_i, count), metrics)

    def rank_fraction(self, models: np.ndarray) -> float | np.ndarray:
        """sum_l rank(W_l) / sum_l min(d1, d2) of a model (or of each row of a chunk's models), as FedSLR's server
        logs for its GKR (FedSLR, Table 2)."""
        import torch

        from raysim.algorithms.prox import matrixize

        rows = np.atleast_2d(models)
        ranks = np.zeros(len(rows))
        full = 0
        for name, shape in zip(self.params.names, self.params.shapes, strict=True):
            if len(shape) < 2:
                continue
            full += min(matrix_shape(shape))
            for row, model in enumerate(rows):
                matrix = matrixize(torch.from_numpy(np.ascontiguousarray(model[self.params.slice(name)])).view(shape))
                ranks[row] += int(torch.linalg.matrix_rank(matrix.to(torch.float64), rtol=1e-5))
        fractions = ranks / max(full, 1)
        return float(fractions[0]) if models.ndim == 1 else fractions

    def server_step(self, server: LpgdServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # (19): uniform mean of the selected local models
        return LpgdServerState(w), metrics

    def downlink_bytes(self, broadcast: Vector) -> int:
        """The model plus the round t (the clients' rate decay, FedSLR, App. B), as float32, as FedSLR counts it."""
        return 4 * (broadcast.size + 1)

    def global_model(self, server: LpgdServerState) -> Vector:
        return server.w
