"""ADMM-based Lp-Proj-2: FLAME's ADMM (Algorithm 1) on the Lp-Proj objective with p = 2 (Appendix C of the FLAME
paper, Algorithm 2, eqs. (182)-(188)). Lp-Proj is Lin et al., "Personalized Federated Learning
towards Communication Efficiency, Robustness and Fairness", NeurIPS 2022:

    min_w sum_i alpha_i F_i(w),  F_i(w) = min_theta f_i(theta) + lambda/2 ||w - P theta||^2          (182), p = 2

with P in R^{d_sub x d} drawn once and fixed: N(0, 1) entries, L2-normalized rows, d_sub = 10 (the authors' code,
FLAME, App. C), drawn here from `projection_seed` so that every host and the coordinator hold the same P. Client i
keeps theta_i in R^d and w_i, pi_i in R^{d_sub}; a selected client runs

    theta_i <- H epochs of SGD, step theta - eta (grad f_i(theta) + lambda P^T (P theta - c))   (185), Alg. 2
    w_i     <- (lambda alpha_i P theta_i + rho w - pi_i) / (lambda alpha_i + rho)            (186)
    pi_i    <- pi_i + rho (w_i - w)                                                         (187)
    u_i      = w_i + pi_i / rho,   w = (1/m) sum_i u_i   (the server's running mean)        (188)

with c = w_i (the paper) or the received w (the authors' code resets w_i := w each round), as FLAME's
`prox_center`. (186) and (187) give pi_i = lambda alpha_i (P theta_i - w_i) after every update, FLAME's Lemma 3
with P theta_i for theta_i (logged as `lemma3_error`). This is the authors' 'FLAME-lp-proj-2' framework flag:
FLAME with the Lp-Proj-2 regularizer is this algorithm, so it is one module rather than a FLAME setting.

`solver: lin` is Lp-Proj as Lin et al. solve it (FedAPM's Table 4 baseline, FedAPM, App. B.5.3): pFedMe's bi-level
scheme on the envelope F_i(w) = min_theta f_i(theta) + lambda/2 ||w - P theta||^2, whose gradient is
lambda (w - P theta_i(w)). A selected client starts from w_i := w and runs R = `local_rounds` times

    theta_i <- H epochs of SGD on f_i(theta) + lambda/2 ||P theta - w_i||^2 (from its persistent theta_i)
    w_i     <- w_i - eta lambda (w_i - P theta_i)                   a gradient step on F_i, eta = `w_lr`

and sends w_i (no dual: pi_i stays 0, the message is w_i); the server averages the latest w_i of all m clients,
as the FLAME authors' server for their 'lp-proj-2' flag and pFedMe's `aggregation: all` (Lin et al.'s server
averages the selected ones, the same under full participation). On quadratics f_i = h_i/2 ||theta - a_i||^2,
F_i(w) = 1/2 (w - P a_i)^T (I/lambda + P P^T/h_i)^{-1} (w - P a_i), and both solvers reach the minimizer of
sum_i F_i (tests/unit/test_lp_proj.py).

The global model lives in R^{d_sub}: "compressed into a lower-dimensional [vector], rendering it no longer useful"
(FLAME, App. C), so Lp-Proj has no usable GM. What is logged as the GM is its minimum-norm lift P^+ w =
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
    row_norms,
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
    solver: Literal["admm", "lin"] = Field(
        "admm",
        description="admm: FLAME's ADMM-based Lp-Proj-2 (Algorithm 2, eqs. 185-188); lin: Lin et al.'s pFedMe-like "
        "solver (NeurIPS 2022): local_rounds of a theta-step and a gradient step on w_i, the mean of the w_i",
    )
    local_rounds: int = Field(1, ge=1, description="R: theta-step then w_i-step pairs per round (solver lin)")
    w_lr: float = Field(0.1, gt=0, description="eta: step of w_i <- w_i - eta lambda (w_i - P theta_i) (solver lin)")


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
        if s.solver == "lin":
            return (yield from self._lin_step(client, state, broadcast))
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

    def _lin_step(self, client: ClientInfo | ClientChunk, state: LpProjClientState, broadcast: Vector) -> ClientStep:
        """Lin et al.'s local rounds (see the module docstring): from w_i = w, R pairs of a theta-step and a gradient
        step on F_i; the message is w_i (pi_i = 0)."""
        s = self.settings
        w_i = np.broadcast_to(np.asarray(broadcast, np.float32), np.shape(state.w)).copy()
        theta, losses = state.theta, list[np.ndarray]()
        for _ in range(s.local_rounds):
            request = s.local_sgd(theta, terms=(ProjectedProx(self.projection, w_i, s.lam),))
            result = yield from train(request)
            theta = np.asarray(result.params, np.float32)
            losses.append(np.asarray(result.mean_loss, np.float64))
            w_i = (w_i - s.w_lr * s.lam * (w_i - self.project(theta))).astype(np.float32)
        old = state.w + state.pi / np.float32(s.rho)
        metrics = {"train_loss": np.mean(losses, axis=0), "primal_residual": row_norms(w_i - broadcast)}
        new = LpProjClientState(theta, w_i, np.zeros_like(state.pi))
        return ClientUpdate(new, DeltaUpload((w_i - old).astype(np.float32)), metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """u_i = w_i + pi_i / rho of the new state, in R^{d_sub}."""
        state = update.state
        return state.w + state.pi / np.float32(self.settings.rho)

    def message_coordinates(self, params: Vector) -> Vector:
        return self.project(params)

    def server_step(self, server: RunningMeanState, total: DeltaUpload, num_selected: int):
        return running_mean(server, total)  # (188): the mean over ALL m clients

    def global_model(self, server: RunningMeanState) -> Vector:
        """No usable GM lives in R^d (FLAME, App. C): the minimum-norm lift P^+ w is what is scored."""
        return self.lift(server.w)

    def personalized_model(self, state: LpProjClientState) -> Vector:
        return state.theta
