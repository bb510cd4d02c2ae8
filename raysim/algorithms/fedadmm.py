"""FedADMM: consensus ADMM over the full model, theta_i = w, solved inexactly by local SGD (FLAME, eq. (19)).

FLAME's problem (9) with lambda -> inf forces theta_i = w_i and reduces to (19), min sum_i alpha_i f_i(theta_i)
s.t. theta_i = w. Implemented directly (not as FLAME with a huge lambda, whose theta-step would be stiff):

    theta_i <- H epochs of SGD on alpha_i f_i(theta) + <pi_i, theta - w> + rho/2 ||theta - w||^2
    pi_i    <- pi_i + rho (theta_i - w),       g = alpha_i (grad f_i(w) + mu_wd w)
    u_i     =  theta_i + pi_i / rho,        w = (1/m) sum over all m clients of their latest u_i

The SGD objective is divided by alpha_i (same minimizer; FLAME's theta-step drops alpha_i the same way).

`reading: zhou_li` is FedADMM as Zhou & Li define it ("Federated Learning via Inexact ADMM", TPAMI 2023, the
Table 4 baseline of FedAPM, App. B.5.3): between two communications a selected client runs k0 =
`local_iterations` ADMM iterations against the received w, each an inexact (linearized) theta-step and a dual step,

    theta_i <- w - (alpha_i (grad f_i(w) + mu_wd w) + pi_i) / (h_i + rho)
             = argmin <g, theta> + h_i/2 ||theta - w||^2 + <pi_i, theta - w> + rho/2 ||theta - w||^2
    pi_i    <- pi_i + rho (theta_i - w),       g = alpha_i (grad f_i(w) + mu_wd w)

with the full-batch gradient at w taken once per round (their code's gW) and h_i = `curvature` (their r_i, an
estimate of alpha_i L_i). With w fixed the duals close in geometrically: pi_i^{(k)} + g = (h_i/(h_i + rho))^k
(pi_i^{(0)} + g), g = alpha_i grad f_i(w). The upload and server are the same (w = mean over all m of
theta_i + pi_i / rho, Zhou & Li's sum_i (sigma_i x_i + pi_i) / sum_i sigma_i with one sigma_i = rho). Their MATLAB
code refines each theta-step up to 3 times under a step-size stop rule; raysim takes the one linearized step of
their algorithm.

Every step reports the primal residual ||theta_i - w||, the dual change and norm ||pi_i||; with `diagnostics: true`
one more full pass gives f_i(theta_i) and its gradient, for the theta-step's stationarity residual and the client's
term of the augmented Lagrangian (raysim.algorithms.families.consensus).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.consensus import (
    DeltaUpload,
    RunningMeanState,
    admm_server_step,
    diagnostic_upload,
    squared_change,
    start_running_mean,
)
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import FullGradient, Number, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Linear, Prox


class FedAdmmSettings(SGDSettings):
    name: Literal["fedadmm"] = "fedadmm"
    rho: float = Field(0.1, gt=0, description="ADMM penalty")
    start: Literal["global", "local"] = Field(
        "global", description="local SGD starts from the received w (inexact ADMM) or warm from theta_i"
    )
    freeze_dual: bool = Field(
        False, description="keep pi_i = 0 (FedProx-like penalty method; with rho -> 0 it is FedAvg, FLAME, Sec. IV-E)"
    )
    diagnostics: bool = Field(
        False,
        description="one more full pass per client for the theta-step's stationarity residual, the augmented "
        "Lagrangian and ||sum_i pi_i|| (docs/algorithms.md, ADMM convergence)",
    )
    reading: Literal["flame", "zhou_li"] = Field(
        "flame",
        description="flame: one theta-step of E epochs of SGD on the augmented Lagrangian and one dual step per "
        "round (FLAME's eq. (19)); zhou_li: Zhou & Li's inexact ADMM (TPAMI 2023, FedAPM's Table 4): "
        "local_iterations linearized theta-steps from w, each with its dual step, one full-batch gradient a round",
    )
    local_iterations: int = Field(
        1, ge=1, description="k0: ADMM iterations a selected client runs between communications (reading zhou_li)"
    )
    curvature: float = Field(
        1.0, gt=0, description="h_i: proximal weight of the linearized theta-step, ~alpha_i L_i (reading zhou_li)"
    )

    @model_validator(mode="after")
    def _check_reading(self) -> FedAdmmSettings:
        if self.reading == "flame" and self.local_iterations != 1:
            raise ValueError(
                f"algorithm.local_iterations={self.local_iterations}: only reading zhou_li runs several ADMM "
                "iterations a round; set reading: zhou_li or local_iterations: 1"
            )
        return self


@dataclass
class FedAdmmClientState:
    theta: Vector
    pi: Vector
    reported_smooth: Number = np.nan
    """With `diagnostics: true`: g_i at the client's last report, NaN before (raysim.algorithms.families.consensus)."""

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
        if s.reading == "zhou_li":
            at_w = yield from gradient(FullGradient(w, "train"))
            theta, pi = self.inexact_iterations(client.weight, at_w.grad, state.pi, w)
            loss: Number = at_w.loss
        else:
            start = w if s.start == "global" else state.theta
            result = yield from train(
                s.local_sgd(start, terms=(Prox(w, s.rho / client.weight), Linear(state.pi / client.weight)))
            )
            theta, loss = result.params, result.mean_loss
            pi = state.pi if s.freeze_dual else (state.pi + s.rho * (theta - w)).astype(np.float32)
        new = FedAdmmClientState(theta.astype(np.float32), pi, state.reported_smooth)
        u = new.message(s.rho)
        metrics = {
            "train_loss": loss,
            "primal_residual": float(np.linalg.norm(new.theta - w)),
            "dual_change": float(np.linalg.norm(new.pi - state.pi)),
            "dual_norm": float(np.linalg.norm(new.pi)),
        }
        change = u - state.message(s.rho)
        if not s.diagnostics:
            return ClientUpdate(new, DeltaUpload(change), metrics)
        at_theta = yield from gradient(FullGradient(new.theta, "train"))
        alpha = client.weight
        # the theta-step's gradient alpha_i grad f_i(theta) + pi_i^t + rho (theta - w^t) at its inexact solution
        metrics["stationarity"] = float(np.linalg.norm(alpha * at_theta.grad + state.pi + s.rho * (new.theta - w)))
        smooth = alpha * float(at_theta.loss)
        upload = diagnostic_upload(
            change,
            smooth=smooth,
            last_smooth=state.reported_smooth,
            pi=new.pi,
            pi_before=state.pi,
            x=new.theta,
            x_before=state.theta,
            w=w,
            rho=s.rho,
            step_squared=squared_change(new.theta, state.theta),
        )
        return ClientUpdate(replace(new, reported_smooth=smooth), upload, metrics)

    def inexact_iterations(self, alpha: float, grad: Vector, pi: Vector, w: Vector) -> tuple[Vector, Vector]:
        """Zhou & Li's k0 local iterations at a fixed w: the linearized theta-step from w on the gradient g =
        alpha_i (grad f_i(w) + mu_wd w), then the dual step; theta_i of the last and the new pi_i (float32)."""
        s = self.settings
        w64 = np.asarray(w, np.float64)
        g = alpha * (np.asarray(grad, np.float64) + s.weight_decay * w64)
        dual = np.asarray(pi, np.float64)
        theta = w64
        for _ in range(s.local_iterations):
            theta = w64 - (g + dual) / (s.curvature + s.rho)
            if not s.freeze_dual:
                dual = dual + s.rho * (theta - w64)
        return theta.astype(np.float32), dual.astype(np.float32)

    def message(self, update: ClientUpdate) -> Vector:
        """u_i = theta_i + pi_i / rho of the new state."""
        return update.state.message(self.settings.rho)

    def server_step(self, server: RunningMeanState, total: DeltaUpload, num_selected: int):
        return admm_server_step(server, total, num_selected, self.settings.rho)  # w = (1/m) sum_i u_i

    def global_model(self, server: RunningMeanState) -> Vector:
        return server.w
