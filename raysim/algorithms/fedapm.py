"""FedAPM: ADMM with partial model personalization; only the shared part is synchronized (fedapm.md 1).

The model splits by parameter name into a personal part v_i (never leaves the client) and a shared part,
of which client i keeps its copy u_i and a dual pi_i. A selected client runs (Algorithm 1, eqs. 9-13)

    v_i  <- E epochs of SGD over v on alpha_i f_i(v, u_i) + sigma_i/2 ||v - v_i||^2     (9), shared part frozen
    u_i  <- E epochs of SGD over x on alpha_i f_i(v_i, x) + <pi_i, x> + rho/2 ||x - u||^2   (11), personal frozen
    pi_i <- pi_i + rho (u_i - u),    z_i = u_i + pi_i / rho                                (12), (13)

and the server keeps the sum of the latest z_i of all m clients: u = (1/m) sum_i z_i (8). SGD runs on the
objective divided by alpha_i with learning rate lr * alpha_i: the same iterates as SGD with lr on the
alpha_i-weighted objective, which is how the authors' code scales every loss gradient by 1/m (1.5).

Every step reports the primal residual ||u_i - u|| (over the synced coordinates), the dual change and norm ||pi_i||;
with `diagnostics: true` one more full pass gives f_i(v_i, u_i) and its gradient, for Definition 2's residual
||alpha_i grad_u f_i(v_i, u_i) + pi_i^t + rho (u_i - u)|| and the client's term of the augmented Lagrangian (4)
(raysim.algorithms.families.consensus).

The GM is the shared part u with the common initial personal part (no v_i is ever sent), i.e. what a
new client would start from; PM is (v_i, u_i).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.consensus import (
    DeltaUpload,
    RunningMeanState,
    admm_server_step,
    diagnostic_upload,
    squared_change,
    start_running_mean,
)
from raysim.algorithms.families.split import SplitSettings, deviation, personal_mask
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import FullGradient, Number, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Linear, Prox
from raysim.models.spec import ParamSpec


class FedApmSettings(SGDSettings, SplitSettings):
    name: Literal["fedapm"] = "fedapm"
    epochs: int = Field(3, ge=1, description="E: local epochs of each phase (v, then u); 3 in the paper")
    lr: float = Field(0.1, gt=0, description="eta: local learning rate on the alpha_i-weighted objective")
    rho: float = Field(0.01, gt=0, description="ADMM penalty (paper grid {0.001, 0.01, 0.02, 0.05, 0.1})")
    sigma: float = Field(0.01, ge=0, description="sigma_i: proximal weight of the v-step (code: 0.01)")
    alpha: float | None = Field(
        None, gt=0, description="alpha_i, the loss weight; default: the client's weight (clients.weighting)"
    )
    v_anchor: Literal["local", "broadcast"] = Field(
        "local", description="shared part seen by the v-step: own u_i (paper, eq. 9) or the received u (code)"
    )
    u_start: Literal["local", "broadcast"] = Field(
        "local", description="u-step warm start: own u_i (paper) or the received u (code)"
    )
    freeze_dual: bool = Field(
        False, description="keep pi_i = 0: with rho -> 0, sigma = 0 and both switches 'broadcast' this is FedAlt"
    )
    reset_personal: bool = Field(
        False,
        description="the authors' CIFAR-10 code (fedapm.md 2, caveat): duals and z_i cover the whole model, the "
        "server averages all of it, and a selected client's personal part starts each round from the aggregate's",
    )
    diagnostics: bool = Field(
        False,
        description="one more full pass per client for Definition 2's residual, the augmented Lagrangian (4) and "
        "||sum_i pi_i|| (docs/algorithms.md, ADMM convergence)",
    )

    def effective_lr(self, num_clients: int, weighting: str) -> str:
        """lr * alpha_i: the step on f_i (alpha_i = 1/m matches the others' loss_scale 1/m)."""
        if self.alpha is None and weighting == "samples":
            return f"{self.lr:.6g}*n_i/n"
        return f"{self.lr * (1.0 / num_clients if self.alpha is None else self.alpha):.6g}"


@dataclass
class FedApmClientState:
    params: Vector
    """The client's full model: v_i on the personal coordinates, u_i on the shared ones."""
    pi: Vector
    """Dual pi_i, shared-part sized."""
    reported_smooth: Number = np.nan
    """With `diagnostics: true`: g_i at the client's last report, NaN before (raysim.algorithms.families.consensus)."""


@dataclass
class FedApmServerState:
    shared: RunningMeanState
    """u, the mean over all m clients of their latest z_i (8), and their sum."""
    template: Vector
    """Initial full model: the personal part of the GM."""

    @property
    def u(self) -> Vector:
        """The shared part of the global model."""
        return self.shared.w


@ALGORITHMS.register()
class FedApm(Algorithm[FedApmSettings, FedApmClientState, FedApmServerState, Vector, DeltaUpload]):
    name = "fedapm"
    Settings = FedApmSettings
    Upload = DeltaUpload

    def __init__(self, settings: FedApmSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.personal = personal_mask(settings, params)
        self.shared = ~self.personal
        self.synced = np.ones_like(self.shared) if settings.reset_personal else self.shared
        """The coordinates of u, pi_i and z_i: the shared part (paper), or the whole model (`reset_personal`)."""

    def init_server(self, init_params: Vector, num_clients: int) -> FedApmServerState:
        return FedApmServerState(start_running_mean(init_params[self.synced], num_clients), init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedApmClientState:
        return FedApmClientState(init_params.copy(), np.zeros(int(self.synced.sum()), np.float32))

    def broadcast(self, server: FedApmServerState) -> Vector:
        return server.u

    def client_step(self, client: ClientInfo, state: FedApmClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        alpha = client.weight if s.alpha is None else s.alpha
        sgd = s.model_copy(update={"lr": s.lr * alpha})
        received = np.zeros_like(state.params)
        received[self.synced] = broadcast
        u = received[self.shared]
        anchor = state.params.copy()
        if s.reset_personal:  # the code's load_remaining_layers(w, 4): the aggregate's head, trained from there
            anchor[self.personal] = received[self.personal]
        start = anchor.copy()
        if s.v_anchor == "broadcast":
            start[self.shared] = u
        v_phase = yield from train(sgd.local_sgd(start, terms=(Prox(anchor, s.sigma / alpha),), mask=self.personal))
        start = v_phase.params.copy()
        if s.u_start == "broadcast":
            start[self.shared] = u
        elif s.v_anchor == "broadcast":
            start[self.shared] = state.params[self.shared]
        center = np.zeros_like(start)
        center[self.shared] = u
        linear = np.zeros_like(start)
        linear[self.synced] = state.pi / alpha
        u_phase = yield from train(
            sgd.local_sgd(start, terms=(Prox(center, s.rho / alpha), Linear(linear)), mask=self.shared)
        )
        params = u_phase.params.astype(np.float32)
        u_i = params[self.shared]
        change = params[self.synced] - broadcast
        pi = state.pi if s.freeze_dual else (state.pi + s.rho * change).astype(np.float32)  # (12)
        new = FedApmClientState(params, pi, state.reported_smooth)
        z, z_old = self.message_of(new), self.message_of(state)
        per_tensor, l2 = deviation(self.params, self.shared, u_i, u)
        metrics = {
            "train_loss": u_phase.mean_loss,
            "v_train_loss": v_phase.mean_loss,
            "deviation": per_tensor,
            "deviation_l2": l2,
            "dual_change": float(np.linalg.norm(pi - state.pi)),
            "primal_residual": float(np.linalg.norm(change)),
            "dual_norm": float(np.linalg.norm(pi)),
        }
        if not s.diagnostics:
            return ClientUpdate(new, DeltaUpload(z - z_old), metrics)
        at_params = yield from gradient(FullGradient(params, "train"))
        synced = params[self.synced]
        # Definition 2: the u_i-step's gradient alpha_i grad_u f_i(v_i, u_i) + pi_i^t + rho (u_i - u^t) at its solution
        residual = alpha * at_params.grad[self.synced] + state.pi + s.rho * (synced - broadcast)
        metrics["stationarity"] = float(np.linalg.norm(residual))
        smooth = alpha * float(at_params.loss)  # (4)
        upload = diagnostic_upload(
            z - z_old,
            smooth=smooth,
            last_smooth=state.reported_smooth,
            pi=pi,
            pi_before=state.pi,
            x=synced,
            x_before=state.params[self.synced],
            w=broadcast,
            rho=s.rho,
            step_squared=squared_change(params, state.params),  # Sigma_p's ||dv_i||^2 + ||du_i||^2
        )
        return ClientUpdate(replace(new, reported_smooth=smooth), upload, metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """z_i of the new state (the message whose change the client uploads)."""
        return self.message_of(update.state)

    def message_of(self, state: FedApmClientState) -> Vector:
        """z_i = u_i + pi_i / rho (13)."""
        return state.params[self.synced].astype(np.float64) + state.pi / self.settings.rho

    def server_step(self, server: FedApmServerState, total: DeltaUpload, num_selected: int):
        shared, metrics = admm_server_step(server.shared, total, num_selected, self.settings.rho)  # (8)
        return FedApmServerState(shared, server.template), metrics

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.synced]

    def global_model(self, server: FedApmServerState) -> Vector:
        full = server.template.copy()
        full[self.synced] = server.u
        return full

    def personalized_model(self, state: FedApmClientState) -> Vector:
        return state.params
