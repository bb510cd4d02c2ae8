"""FLAME: personalized FL with the Moreau envelope, solved by inexact multi-block ADMM (FLAME, Sec. IV, Alg. 1).

Client i keeps theta_i (personalized model), w_i (local model) and pi_i (dual). A selected client runs

    theta_i <- H epochs of SGD on f_i(theta) + lambda/2 ||theta - c||^2        (11), Alg. 1 line 12
    w_i     <- (lambda alpha_i theta_i + rho w - pi_i) / (lambda alpha_i + rho)  (12)
    pi_i    <- pi_i + rho (w_i - w)                                            (13)
    u_i     =  w_i + pi_i / rho

with prox centre c = w_i (paper) or the received w (authors' code). The server keeps the running sum
of the latest u_i of all m clients, so w = (1/m) sum_i u_i (14) needs only the selected clients'
changes u_i^new - u_i^old. Unselected clients keep all their state.

The client step runs (12), (13) and the message change as one compiled pass over each client's vectors
(`admm_update`, a raysim.jit kernel over rows), so the same lines update one client's vectors or a chunk's
stacked rows (`Algorithm.stacks`), reading theta_i, w_i and pi_i once.

Every step reports the primal residual ||w_i - w||, the dual change and norm ||pi_i||, and Lemma 3's error; with
`diagnostics: true` one more full pass over the training set gives f_i(theta_i) and its gradient, for the
stationarity residual (17) and the client's term of the augmented Lagrangian (10) (families/consensus.py).
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
    admm_update,
    diagnostic_upload,
    paper_message,
    row_norms,
    squared_change,
    start_running_mean,
)
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    CodeDraws,
)
from raysim.algorithms.requests import FullGradient, Number, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Prox
from raysim.jit import distances, rows


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
    diagnostics: bool = Field(
        False,
        description="one more full pass per client for the stationarity residual (17), the augmented Lagrangian "
        "L(P^t) (10) and ||sum_i pi_i|| (docs/algorithms.md, ADMM convergence)",
    )

    @model_validator(mode="after")
    def _check_random_epochs(self) -> FlameSettings:
        """Per-epoch dual updates train one epoch per request, which random_epochs would draw from 1..1."""
        if self.random_epochs and self.dual_updates == "per_epoch":
            raise ValueError(
                "algorithm.random_epochs draws the passes of one local training; algorithm.dual_updates=per_epoch "
                "trains one epoch at a time: set algorithm.dual_updates: per_round"
            )
        return self


@dataclass
class FlameClientState:
    theta: Vector
    w: Vector
    pi: Vector
    reported_smooth: Number = np.nan
    """With `diagnostics: true`: g_i at the client's last report, NaN before (raysim.algorithms.families.consensus)."""

    def message(self, rho: float) -> Vector:
        """u_i, the vector the server averages."""
        return paper_message(self.w, self.pi, rho)


@ALGORITHMS.register()
class Flame(Algorithm[FlameSettings, FlameClientState, RunningMeanState, Vector, DeltaUpload]):
    name = "flame"
    Settings = FlameSettings
    Upload = DeltaUpload

    @classmethod
    def code_draws(cls, settings: FlameSettings) -> CodeDraws:
        """One pass per local epoch (their update_weights' loop over the trainloader)."""
        return CodeDraws(passes=settings.epochs)

    stacks = True

    def init_server(self, init_params: Vector, num_clients: int) -> RunningMeanState:
        return start_running_mean(init_params, num_clients)  # theta_i^0 = w_i^0 = w^0, pi_i^0 = 0 (authors' code)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FlameClientState:
        # pi^0 = lambda alpha_i (theta^0 - w^0) = 0, the initialization Lemma 3 requires (eq. 33). theta and w
        # share the host's read-only initial vector until the first step replaces them (steps never write into
        # a state's vectors), so thousands of clients cost nothing before they train.
        return FlameClientState(init_params, init_params, np.zeros(init_params.shape, init_params.dtype))

    def broadcast(self, server: RunningMeanState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo | ClientChunk, state: FlameClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        w = broadcast
        lam_alpha = np.atleast_1d(s.lam * np.asarray(client.weight)).astype(np.float32)  # one per row
        passes = [s.epochs] if s.dual_updates == "per_round" else [1] * s.epochs
        # A donated state (ClientChunk.in_place) is trained and updated where it is, else copies of w_i and pi_i are
        # updated; dual updates per epoch keep the round's starting state to the end.
        keep = len(passes) > 1
        w_i, pi = client.writable(state.w, state.pi, keep=keep)
        theta, in_place = state.theta, client.may_write(keep)
        # a donated state is updated where it is: the diagnostics keep the round's starting point
        before = [np.array(v, copy=True) for v in (theta, w_i, pi)] if s.diagnostics else None
        losses = []
        for epochs in passes:
            center = w_i if s.prox_center == "local" else w
            result = yield from train(s.local_sgd(theta, epochs, terms=(Prox(center, s.lam),), in_place=in_place))
            losses.append(result.mean_loss)  # a number, or one per row
            theta, in_place = np.asarray(result.params, np.float32), True  # later epochs train the step's own theta
            if s.diagnostics:  # w_i^t of (17), before (12) writes the new w_i over it
                center = np.array(center, copy=True)
            delta_u, primal, dual, lemma3 = admm_update(
                rows(theta), rows(w_i), rows(pi), w, lam_alpha, np.float32(s.rho)
            )
        new = FlameClientState(theta, w_i, pi, state.reported_smooth)
        if len(passes) > 1:  # the message's change and the dual's since the round's start, not the last epoch's
            delta_u, dual = new.message(s.rho) - state.message(s.rho), distances(new.pi, state.pi)
        metrics = {
            "train_loss": np.mean(np.array(losses), axis=0),
            "primal_residual": primal,
            "dual_change": dual,
            "lemma3_error": lemma3,
            "dual_norm": row_norms(pi),
        }
        change = delta_u.reshape(np.shape(theta))
        if before is None:
            return ClientUpdate(new, DeltaUpload(change), metrics)
        theta_before, w_before, pi_before = before
        at_theta = yield from gradient(FullGradient(theta, "train"))
        alpha = np.asarray(client.weight, np.float64)
        # (17): ||alpha_i (grad f_i(theta_i^{t+1}) + lambda (theta_i^{t+1} - c))||, c the theta-step's prox centre
        metrics["stationarity"] = row_norms(alpha[..., None] * (at_theta.grad + s.lam * (theta - center)))
        # (10): g_i = alpha_i (f_i(theta_i) + lambda/2 ||theta_i - w_i||^2), f_i the full-batch training loss
        smooth = alpha * (np.asarray(at_theta.loss, np.float64) + s.lam / 2 * squared_change(theta, w_i))
        upload = diagnostic_upload(
            change,
            smooth=smooth,
            last_smooth=state.reported_smooth,
            pi=pi,
            pi_before=pi_before,
            x=w_i,
            x_before=w_before,
            w=w,
            rho=s.rho,
            step_squared=squared_change(theta, theta_before) + squared_change(w_i, w_before),  # Delta Gamma's
        )
        return ClientUpdate(replace(new, reported_smooth=smooth), upload, metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """u_i = w_i + pi_i / rho of the new state (asked for only by attacks and robust aggregation)."""
        return update.state.message(self.settings.rho)

    def server_step(self, server: RunningMeanState, total: DeltaUpload, num_selected: int):
        return admm_server_step(server, total, num_selected, self.settings.rho)  # (14): the mean over ALL m clients

    def global_model(self, server: RunningMeanState) -> Vector:
        return server.w

    def personalized_model(self, state: FlameClientState) -> Vector:
        return state.theta
