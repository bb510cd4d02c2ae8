"""AugFL: inexact-ADMM federated meta-learning with a server-side pretrained-model regularizer (augfl.md 1.6).

Client i, given the meta-model theta^t, with full-batch gradients on its support set (`support_split`)
and query set (`query_split`):

    phi_i   = theta - alpha grad L_i(theta, D^s)                                          (7)
    r_i     = grad L_i(phi_i, D^q)
    g_i     = [grad L_i(theta + delta r_i, D^s) - grad L_i(theta - delta r_i, D^s)] / (2 delta)   (10)
    theta_i = theta - (y_i + w_i (r_i - alpha g_i)) / rho                                 (11)
    y_i     = y_i + rho (theta_i - theta)                                                 (12)

with delta = 1/(10k + 100) at the client's k-th participation (k = 1, 2, ...). The server keeps the sum
over ALL clients of y_i + rho theta_i (unselected clients count with their last values, augfl.md 1.8(f))
and sets theta^{t+1} = (sum_i (y_i + rho theta_i) - lambda grad R_h(theta^t, theta_p)) / (m rho)   (13).

R_h here is `regularizer`: none (AugFL without PM, lambda R_h = 0) or l2 = ||theta - theta_p||^2 (the
theory's same-architecture case) with theta_p read by the coordinator only, from `pm_path`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.base import (
    Algorithm,
    AlgorithmSettings,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    FullGradient,
    Upload,
    Vector,
)


class AugFlSettings(AlgorithmSettings):
    name: Literal["augfl"] = "augfl"
    alpha: float = Field(0.03, gt=0, description="alpha: one-step adaptation rate (0.03 in the paper, Table I)")
    rho: float = Field(0.7, gt=0, description="rho_i: ADMM penalty, the same for every client (Table I)")
    lam: float = Field(5.0, ge=0, alias="lambda", description="lambda: weight of the PM regularizer R_h (Table I)")
    hessian: Literal["finite_difference", "first_order"] = Field(
        "finite_difference", description="g_i by eq. 10 (paper) or g_i = 0 (first-order ablation)"
    )
    delta_scale: float = Field(10.0, gt=0, description="delta_k = 1/(delta_scale k + delta_offset): 1/(10k + 100)")
    delta_offset: float = Field(100.0, gt=0)
    support_split: Literal["train", "val", "test"] = Field("train", description="the client's split used as D^s")
    query_split: Literal["train", "val", "test"] = Field("val", description="the client's split used as D^q")
    regularizer: Literal["none", "l2"] = Field(
        "none", description="R_h: none (AugFL w/o PM) or ||theta - theta_p||^2 (same architecture as the PM)"
    )
    pm_path: str | None = Field(None, description="flat float32 .npy of theta_p (regularizer = l2)")

    @model_validator(mode="after")
    def _pm_needed(self) -> AugFlSettings:
        if self.regularizer == "l2" and self.pm_path is None:
            raise ValueError("algorithm.pm_path: regularizer = l2 needs the PM's parameters (.npy)")
        return self


@dataclass
class AugFlClientState:
    y: Vector
    """y_i, the dual (= -w_i times the meta-gradient estimate after the first participation, augfl.md 1.8(a))."""
    theta: Vector
    """theta_i, the last local meta-model."""
    phi: Vector
    """phi_i, the model adapted from the last received theta (the personalized model)."""
    participations: int


@dataclass
class AugFlServerState:
    theta: Vector
    total: np.ndarray
    """float64 sum over all m clients of y_i + rho theta_i (their latest values)."""
    num_clients: int


@dataclass
class AugFlUpload(Upload):
    """theta_i and y_i, sent as their changes so that the server can keep its sum over all clients exact."""

    delta_y: Vector
    delta_theta: Vector


class AugFl(Algorithm[AugFlSettings, AugFlClientState, AugFlServerState, Vector, AugFlUpload]):
    name = "augfl"
    Settings = AugFlSettings
    Upload = AugFlUpload
    _pm: np.ndarray | None = None

    def pm(self) -> np.ndarray:
        """theta_p, loaded on first use by the server step only, so it never reaches a client host."""
        if self._pm is None:
            pm = np.load(Path(self.settings.pm_path).expanduser()).astype(np.float64)  # type: ignore[arg-type]
            if pm.shape != (self.params.size,):
                raise ValueError(f"algorithm.pm_path: PM has {pm.size} parameters, the model {self.params.size}")
            self._pm = pm
        return self._pm

    def init_server(self, init_params: Vector, num_clients: int) -> AugFlServerState:
        # y_i^{-1} = 0 (authors' code) and theta_i^{-1} = theta^0 for every client.
        total = num_clients * self.settings.rho * init_params.astype(np.float64)
        return AugFlServerState(init_params.copy(), total, num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> AugFlClientState:
        return AugFlClientState(np.zeros_like(init_params), init_params.copy(), init_params.copy(), 0)

    def broadcast(self, server: AugFlServerState) -> Vector:
        return server.theta

    def delta(self, participation: int) -> float:
        return 1.0 / (self.settings.delta_scale * participation + self.settings.delta_offset)

    def client_step(self, client: ClientInfo, state: AugFlClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        theta = broadcast.astype(np.float64)
        support = yield FullGradient(broadcast, s.support_split)
        phi = theta - s.alpha * support.grad  # (7)
        query = yield FullGradient(phi.astype(np.float32), s.query_split)
        r = query.grad.astype(np.float64)
        k = state.participations + 1
        g = np.zeros_like(theta)
        if s.hessian == "finite_difference":
            delta = self.delta(k)
            plus = yield FullGradient((theta + delta * r).astype(np.float32), s.support_split)
            minus = yield FullGradient((theta - delta * r).astype(np.float32), s.support_split)
            g = (plus.grad.astype(np.float64) - minus.grad) / (2 * delta)  # (10)
        meta_gradient = r - s.alpha * g
        theta_i = theta - (state.y + client.weight * meta_gradient) / s.rho  # (11)
        y = state.y + s.rho * (theta_i - theta)  # (12)
        new = AugFlClientState(y.astype(np.float32), theta_i.astype(np.float32), phi.astype(np.float32), k)
        metrics = {
            "support_loss": support.loss,
            "query_loss": query.loss,
            "primal_residual": float(np.linalg.norm(theta_i - theta)),
            "dual_change": float(np.linalg.norm(y - state.y)),
            "meta_gradient_norm": float(np.linalg.norm(meta_gradient)),
        }
        upload = AugFlUpload(
            (y - state.y).astype(np.float64), (theta_i - state.theta.astype(np.float64)).astype(np.float64)
        )
        return ClientUpdate(new, upload, metrics)

    def regularizer_gradient(self, theta: np.ndarray) -> np.ndarray:
        """grad_theta R_h(theta, theta_p) at theta^t (eq. 13)."""
        if self.settings.regularizer == "none" or self.settings.lam == 0:
            return np.zeros_like(theta)
        return 2.0 * (theta - self.pm())

    def server_step(self, server: AugFlServerState, total: AugFlUpload, num_selected: int):
        s = self.settings
        summed = server.total + total.delta_y + s.rho * total.delta_theta
        previous = server.theta.astype(np.float64)
        reg = self.regularizer_gradient(previous)
        theta = ((summed - s.lam * reg) / (server.num_clients * s.rho)).astype(np.float32)  # (13)
        metrics = {
            "global_change": float(np.linalg.norm(theta - server.theta)),
            "regularizer_gradient_norm": float(np.linalg.norm(reg)),
            "effective_step": 1.0 / (server.num_clients * s.rho),
        }
        return AugFlServerState(theta, summed, server.num_clients), metrics

    def global_model(self, server: AugFlServerState) -> Vector:
        return server.theta

    def personalized_model(self, state: AugFlClientState) -> Vector:
        return state.phi
