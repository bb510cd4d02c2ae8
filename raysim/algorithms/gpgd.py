"""GPGD: global proximal gradient descent, FedSLR's ablation with the nuclear prox only at the server (Huang, Shen,
Sun, Lin, Tao, "Fusion of Global and Local Knowledge for Personalized Federated Learning", TMLR 2023, Appendix A.2).

Clients run FedAvg's local SGD from the received low-rank model w_t, with no dual variable and no proximal term

    w_{i,t,k+1} = w_{i,t,k} - eta_l grad f_i(w_{i,t,k}; xi)                                      (eq. 20)

and the server takes the nuclear-norm prox of their uniform mean over the selected clients (Alg. 2's 1/|S_t|)

    w_{t+1} = Prox_{lambda eta_g sum_l ||.||_*}( (1/|S_t|) sum_{S_t} w_{i,t,K} )                   (eq. 21)

layer-wise as FedSLR's server (raysim.algorithms.fedslr.LowRankProx; biases and 1-D parameters pass unchanged).
It is FedSLR's Phase I with gamma = 0 and no 1/(2 eta_g) term (FedSLR, App. A.2): the threshold is FedSLR's
lambda eta_g, so that only the client step differs, and the downlink is the same factored model (its costs "match
FedSLR's", A.2). Client drift makes sum_k grad f_i(w_{i,t,k}) differ from grad f_i(w_t), so it is not proximal
gradient descent on (P1) and has no convergence guarantee. The local rate decays as FedSLR's (FedSLR, App. B). With
lambda = 0 it is FedAvg with uniform aggregation. The step stacks; there is no personal model (GM only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.dynamic import DynamicSolverSettings
from raysim.algorithms.families.lowrank import LowRankBroadcast, LowRankProx, LowRankUpload
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.prox import FactoredModel
from raysim.algorithms.requests import Vector, train
from raysim.jit import distances
from raysim.models.spec import ParamSpec


class GpgdSettings(DynamicSolverSettings):
    name: Literal["gpgd"] = "gpgd"
    lam: float = Field(1e-4, ge=0, alias="lambda", description="lambda: nuclear-norm (low-rank) penalty")
    eta_g: float = Field(10.0, gt=0, description="eta_g: the server's proximal step; SVT threshold lambda * eta_g")
    svd_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the server SVD runs: auto = cuda if the coordinator has a GPU, else cpu"
    )


@dataclass
class GpgdClientState:
    """GPGD keeps nothing on the client between rounds."""


@dataclass
class GpgdServerState:
    w: Vector
    """The low-rank global model, = model.params."""
    model: FactoredModel
    """w as sent: low-rank layers as the factors of the server's SVD (FedSLR, Alg. 1 line 3)."""
    ranks: dict[str, int]


@ALGORITHMS.register()
class Gpgd(Algorithm[GpgdSettings, GpgdClientState, GpgdServerState, LowRankBroadcast, LowRankUpload]):
    name = "gpgd"
    Settings = GpgdSettings
    Upload = LowRankUpload
    stacks = True

    def __init__(self, settings: GpgdSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.low_rank = LowRankProx(params, settings.svd_device)

    def init_server(self, init_params: Vector, num_clients: int) -> GpgdServerState:
        w = np.asarray(init_params, dtype=np.float32).copy()  # w_0 is sent dense: its ranks count as full
        return GpgdServerState(w, FactoredModel.of_dense(w), self.low_rank.full_ranks())

    def init_client(self, client: ClientInfo, init_params: Vector) -> GpgdClientState:
        return GpgdClientState()

    def broadcast(self, server: GpgdServerState) -> LowRankBroadcast:
        return LowRankBroadcast(server.model, server.ranks)

    def client_step(
        self, client: ClientInfo | ClientChunk, state: GpgdClientState, broadcast: LowRankBroadcast
    ) -> ClientStep:
        s = self.settings
        w_t = broadcast.model.params(self.params)
        lr = s.lr  # eta_l * decay^t (LrSchedule.at_round)
        result = yield from train(s.local_sgd(w_t))  # (20)
        w_i = np.asarray(result.params, np.float32)
        count = np.ones_like(np.asarray(client.num_train, np.float32))  # a number, or one per row of a chunk
        metrics = {"train_loss": result.mean_loss, "update_norm": distances(w_i, w_t), "lr": lr}
        return ClientUpdate(state, LowRankUpload(per_row(count) * w_i, count), metrics)

    def server_step(self, server: GpgdServerState, total: LowRankUpload, num_selected: int):
        s = self.settings
        mean = np.asarray(total.w, np.float64) / np.asarray(total.count, np.float64)
        prox, metrics = self.low_rank(mean, s.lam * s.eta_g, server.w)  # (21)
        return GpgdServerState(prox.params, prox.model, prox.ranks), metrics

    def downlink_bytes(self, broadcast: LowRankBroadcast) -> int:
        """The factored model's dense layers and factors (FedSLR, Alg. 1 line 3), plus the round t (the clients' rate
        decay), as float32 (FedSLR's)."""
        return 4 * (broadcast.model.size + 1)

    def global_model(self, server: GpgdServerState) -> Vector:
        return server.w

    def model_tables(self, global_params: Vector) -> dict[str, dict[str, list]]:
        """`spectra`: the singular values of every layer of the final low-rank model, as FedSLR's."""
        return self.low_rank.spectra_table(global_params)
