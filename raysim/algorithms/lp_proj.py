"""ADMM-based Lp-Proj-2: FLAME's ADMM (Algorithm 1) on the Lp-Proj objective with p = 2 (Appendix C of the FLAME
paper, Algorithm 2, eqs. (182)-(188); spec/flame.md 2.5). Lp-Proj is Lin et al., "Personalized Federated Learning
towards Communication Efficiency, Robustness and Fairness", NeurIPS 2022:

    min_w sum_i alpha_i F_i(w),  F_i(w) = min_theta f_i(theta) + lambda/2 ||w - P theta||^2          (182), p = 2

with P in R^{d_sub x d} drawn once and fixed: N(0, 1) entries, L2-normalized rows, d_sub = 10 (the authors' code,
flame.md 2.5), drawn here from `projection_seed` so that every host and the coordinator hold the same P. Client i
keeps theta_i in R^d and w_i, pi_i in R^{d_sub}; a selected client runs

    theta_i <- H epochs of SGD, step theta - eta (grad f_i(theta) + lambda P^T (P theta - c))   (185), Alg. 2
    w_i     <- (lambda alpha_i P theta_i + rho w - pi_i) / (lambda alpha_i + rho)            (186)
    pi_i    <- pi_i + rho (w_i - w)                                                         (187)
    u_i      = w_i + pi_i / rho,   w = (1/m) sum_i u_i   (the server's running mean)        (188)

with c = w_i (the paper) or the received w (the authors' code resets w_i := w each round), as FLAME's
`prox_center`. (186) and (187) give pi_i = lambda alpha_i (P theta_i - w_i) after every update, FLAME's Lemma 3
with P theta_i for theta_i (logged as `lemma3_error`). This is the authors' 'FLAME-lp-proj-2' framework flag:
FLAME with the Lp-Proj-2 regularizer is this algorithm, so it is one module rather than a FLAME setting. (Their
'lp-proj-2' flag is Lin et al.'s own pFedMe-like solver: a gradient step on w_i instead of (186)-(187).)

The global model lives in R^{d_sub}: "compressed into a lower-dimensional [vector], rendering it no longer useful"
(flame.md 2.5), so Lp-Proj has no usable GM. What is logged as the GM is its minimum-norm lift P^+ w =
P^T (P P^T)^{-1} w, the smallest model whose projection is w: it scores about as an untrained model, which is the
paper's point. Messages (and robust aggregation) are in R^{d_sub}: `message_coordinates` projects. A client sends
u_i's change and receives w, d_sub numbers each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.consensus import (
    DeltaUpload,
    RunningMeanState,
    admm_update,
    running_mean,
    start_running_mean,
)
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientChunk, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import ProjectedProx
from raysim.jit import rows
from raysim.models.spec import ParamSpec


class LpProjSettings(SGDSettings):
    name: Literal["lp_proj"] = "lp_proj"
    lam: float = Field(1.0, gt=0, alias="lambda", description="lambda: weight of lambda/2 ||w - P theta||^2")
    rho: float = Field(0.1, gt=0, description="ADMM penalty")
    d_sub: int = Field(10, ge=1, description="rows of P, the dimension of w_i, pi_i and w (10 in the authors' code)")
    projection_seed: int = Field(0, ge=0, description="seed of P's N(0, 1) draw (the same P on every host)")
    prox_center: Literal["local", "global"] = Field(
        "local", description="theta-step centre: w_i (paper, Alg. 2) or the received w (authors' code), as FLAME's"
    )


def gaussian_projection(d_sub: int, d: int, seed: int) -> np.ndarray:
    """P [d_sub, d]: N(0, 1) entries with each row scaled to unit L2 norm (the authors' F.normalize(Proj, dim=1))."""
    draw = np.random.default_rng(seed).standard_normal((d_sub, d))
    return (draw / np.linalg.norm(draw, axis=1, keepdims=True)).astype(np.float32)


@dataclass
class LpProjClientState:
    theta: Vector
    """theta_i in R^d, the personalized model."""
    w: Vector
    """w_i in R^{d_sub}."""
    pi: Vector
    """pi_i in R^{d_sub}, the dual."""


@ALGORITHMS.register()
class LpProj(Algorithm[LpProjSettings, LpProjClientState, RunningMeanState, Vector, DeltaUpload]):
    name = "lp_proj"
    Settings = LpProjSettings
    Upload = DeltaUpload
    stacks = True

    def __init__(self, settings: LpProjSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.projection = gaussian_projection(settings.d_sub, params.size, settings.projection_seed)

    def project(self, theta: np.ndarray) -> np.ndarray:
        """P theta (each row of a chunk's [k, d])."""
        return (theta @ self.projection.T).astype(np.float32)

    def lift(self, w: np.ndarray) -> np.ndarray:
        """P^+ w = P^T (P P^T)^{-1} w, the least-norm model whose projection is w."""
        p = self.projection.astype(np.float64)
        return (p.T @ np.linalg.solve(p @ p.T, np.asarray(w, np.float64))).astype(np.float32)

    def init_server(self, init_params: Vector, num_clients: int) -> RunningMeanState:
        return start_running_mean(self.project(init_params), num_clients)  # w^0 = P theta^0 (authors' code)

    def init_client(self, client: ClientInfo, init_params: Vector) -> LpProjClientState:
        # pi^0 = lambda alpha_i (P theta^0 - w_i^0) = 0 with w_i^0 = P theta^0.
        projected = self.project(init_params)
        return LpProjClientState(init_params, projected, np.zeros_like(projected))

    def broadcast(self, server: RunningMeanState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo | ClientChunk, state: LpProjClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        lam_alpha = np.atleast_1d(s.lam * np.asarray(client.weight)).astype(np.float32)  # one per row
        w_i, pi = client.writable(state.w, state.pi)
        center = w_i if s.prox_center == "local" else broadcast
        request = s.local_sgd(
            state.theta,
            terms=(ProjectedProx(self.projection, center, s.lam),),
            in_place=client.may_write(),
        )
        result = yield from train(request)
        theta = np.asarray(result.params, np.float32)
        projected = self.project(theta)
        delta_u, primal, dual, lemma3 = admm_update(  # (186), (187) on P theta_i, FLAME's kernel
            rows(projected), rows(w_i), rows(pi), broadcast, lam_alpha, np.float32(s.rho)
        )
        metrics = {
            "train_loss": result.mean_loss,
            "primal_residual": primal,
            "dual_change": dual,
            "lemma3_error": lemma3,
        }
        new = LpProjClientState(theta, w_i, pi)
        return ClientUpdate(new, DeltaUpload(delta_u.reshape(np.shape(w_i))), metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """u_i = w_i + pi_i / rho of the new state, in R^{d_sub}."""
        state = update.state
        return state.w + state.pi / np.float32(self.settings.rho)

    def message_coordinates(self, params: Vector) -> Vector:
        return self.project(params)

    def server_step(self, server: RunningMeanState, total: DeltaUpload, num_selected: int):
        return running_mean(server, total)  # (188): the mean over ALL m clients

    def global_model(self, server: RunningMeanState) -> Vector:
        """No usable GM lives in R^d (flame.md 2.5): the minimum-norm lift P^+ w is what is scored."""
        return self.lift(server.w)

    def personalized_model(self, state: LpProjClientState) -> Vector:
        return state.theta
