"""FedAPM: ADMM with partial model personalization; only the shared part is synchronized (FedAPM, Alg. 1).

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

**Theory mode** (`stop_rule: tolerance`, FedAPM, eq. (15), Def. 2; Lemma 1): a selected client tightens its tolerance
xi_i^{t+1} = mu_i xi_i^t (10) and repeats the u-step's E epochs from where they ended until Definition 2 holds,

    ||alpha_i (grad_u f_i(v_i^{t+1}, u_i^{t+1}) + mu_wd u_i^{t+1}) + pi_i^t + rho (u_i^{t+1} - u^t)||^2 <= xi_i^{t+1},

checked after each pass on a full-batch gradient (at most `max_passes` passes; the experiments' fixed E epochs are
`stop_rule: epochs`). The analysis takes the v-step (9) exact; here it runs to the same tolerance on its residual
||alpha_i (grad_v f_i + mu_wd v_i) + sigma_i (v_i - v_i^t)||^2. With `diagnostics: true` the server also keeps
sum_i xi_i, sum_i u_i and sum_i ||u_i||^2 over ALL m clients (beside the message, not sent), and logs the Lyapunov
function (17) L~ = L + sum_i 29 / (rho (1 - mu_i)) xi_i and the primal residual of all m clients,
sqrt(sum_i ||u_i - u||^2).

The GM is the shared part u with the common initial personal part (no v_i is ever sent), i.e. what a
new client would start from; PM is (v_i, u_i).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.consensus import (
    AdmmDiagnosticUpload,
    DeltaUpload,
    RunningMeanState,
    admm_server_step,
    diagnostic_upload,
    squared_change,
    start_running_mean,
)
from raysim.algorithms.families.split import SplitSettings, deviation, personal_mask, shared_segments
from raysim.algorithms.interface import ALGORITHMS, NOT_SENT, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import FullGradient, Number, Request, Result, SGDResult, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Linear, Prox, Term
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
        description="the authors' CIFAR-10 code (unlike FedAPM's Sec. 3.4 split): duals and z_i cover the whole model, "
        "the server averages all of it, and a selected client's personal part starts each round from the aggregate's",
    )
    diagnostics: bool = Field(
        False,
        description="one more full pass per client for Definition 2's residual, the augmented Lagrangian (4) and "
        "||sum_i pi_i|| (docs/algorithms.md, ADMM convergence)",
    )
    stop_rule: Literal["epochs", "tolerance"] = Field(
        "epochs",
        description="u-step length: E epochs (the experiments, FedAPM, App. B.3) or the theory's xi_i-approximate "
        "solve (Definition 2): E-epoch passes until the residual's square is at most xi_i^{t+1} = mu_i xi_i^t (10)",
    )
    tolerance: float = Field(1.0, gt=0, description="xi_i^0: every client's initial tolerance (stop_rule tolerance)")
    tolerance_decay: float = Field(
        0.5, gt=0, lt=1, description="mu_i in (0, 1): a selected client's xi_i shrinks by it each round (10)"
    )
    max_passes: int = Field(
        20, ge=1, description="stop_rule tolerance: at most this many E-epoch passes of the u-step per round"
    )

    @model_validator(mode="after")
    def _check_theory_mode(self) -> FedApmSettings:
        if self.stop_rule == "tolerance" and self.reset_personal:
            raise ValueError(
                "algorithm.stop_rule=tolerance: Definition 2 is the u-step's residual over the shared part; "
                "reset_personal=true syncs the whole model (use stop_rule epochs or reset_personal false)"
            )
        return self

    def lyapunov_weight(self) -> float:
        """29 / (rho (1 - mu_i)): the weight of sum_i xi_i in the Lyapunov function (17)."""
        return 29.0 / (self.rho * (1.0 - self.tolerance_decay))

    def effective_lr(self, num_clients: int, weighting: str) -> str:
        """lr * alpha_i: the step on f_i (alpha_i = 1/m matches the others' loss_scale 1/m)."""
        if self.alpha is None and weighting != "uniform":
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
    xi: Number = np.nan
    """xi_i^t, the tolerance of Definition 2 (stop_rule tolerance; NaN: xi_i^0 = `tolerance`, not yet selected)."""


@dataclass
class FedApmDiagnosticUpload(AdmmDiagnosticUpload):
    """FedAPM's diagnostic upload: also the changes of u_i, ||u_i||^2 and xi_i (not sent), which keep the server's
    sums over all m clients behind the Lyapunov function (17) and the primal residual of all clients."""

    shared_change: Vector = field(metadata=NOT_SENT)
    """u_i^{t+1} - u_i^t."""
    shared_square_change: Number = field(metadata=NOT_SENT)
    """||u_i^{t+1}||^2 - ||u_i^t||^2."""
    tolerance_change: Number = field(metadata=NOT_SENT)
    """xi_i^{t+1} - xi_i^t (0 with stop_rule epochs: xi_i = 0 there, exact solves as far as (17) knows)."""


@dataclass
class TheoryTotals:
    """With `diagnostics: true`, sums over ALL m clients (stale ones included), moved by the uploads' changes."""

    shared_sum: np.ndarray
    """float64: sum_i u_i."""
    shared_square_sum: float
    """sum_i ||u_i||^2."""
    tolerance_sum: float
    """sum_i xi_i^t."""


@dataclass
class FedApmServerState:
    shared: RunningMeanState
    """u, the mean over all m clients of their latest z_i (8), and their sum."""
    template: Vector
    """Initial full model: the personal part of the GM."""
    totals: TheoryTotals | None = None
    """With `diagnostics: true`: the sums behind `lyapunov` and `primal_residual` (raysim.algorithms.fedapm)."""

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
        self.segments = shared_segments(params, self.shared)
        """The shared tensors' ranges in the shared part, which every client step's deviation reads."""
        self.synced = np.ones_like(self.shared) if settings.reset_personal else self.shared
        """The coordinates of u, pi_i and z_i: the shared part (paper), or the whole model (`reset_personal`)."""

    def init_server(self, init_params: Vector, num_clients: int) -> FedApmServerState:
        totals = None
        if self.settings.diagnostics:
            u0 = init_params[self.synced].astype(np.float64)
            xi0 = self.settings.tolerance if self.settings.stop_rule == "tolerance" else 0.0
            totals = TheoryTotals(num_clients * u0, num_clients * float(u0 @ u0), num_clients * xi0)
        shared = start_running_mean(init_params[self.synced], num_clients)
        return FedApmServerState(shared, init_params.copy(), totals)

    def tolerance_of(self, state: FedApmClientState) -> float:
        """xi_i^t: the state's, or xi_i^0 before the client's first round; 0 with stop_rule epochs."""
        if self.settings.stop_rule != "tolerance":
            return 0.0
        return self.settings.tolerance if np.isnan(state.xi) else float(state.xi)

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
        theory = s.stop_rule == "tolerance"
        xi = s.tolerance_decay * self.tolerance_of(state) if theory else 0.0  # (10)
        v_terms = (Prox(anchor, s.sigma / alpha),)
        v_phase = yield from train(sgd.local_sgd(start, terms=v_terms, mask=self.personal))
        stop: dict[str, float] = {}
        if theory:  # the analysis solves (9) exactly: here to the same tolerance, on its own residual

            def v_residual(x: np.ndarray, grad: np.ndarray) -> np.ndarray:
                mask = self.personal
                return alpha * grad[mask] + s.sigma * (x[mask] - anchor[mask])

            v_phase, passes, _ = yield from self._solve_to_tolerance(
                v_phase, sgd, v_terms, self.personal, v_residual, xi
            )
            stop["v_stop_passes"] = passes
        start = v_phase.params.copy()
        if s.u_start == "broadcast":
            start[self.shared] = u
        elif s.v_anchor == "broadcast":
            start[self.shared] = state.params[self.shared]
        center = np.zeros_like(start)
        center[self.shared] = u
        linear = np.zeros_like(start)
        linear[self.synced] = state.pi / alpha
        u_terms = (Prox(center, s.rho / alpha), Linear(linear))
        u_phase = yield from train(sgd.local_sgd(start, terms=u_terms, mask=self.shared))
        if theory:  # Definition 2

            def u_residual(x: np.ndarray, grad: np.ndarray) -> np.ndarray:
                mask = self.shared
                return alpha * grad[mask] + state.pi + s.rho * (x[mask] - u)

            u_phase, passes, square = yield from self._solve_to_tolerance(
                u_phase, sgd, u_terms, self.shared, u_residual, xi
            )
            stop |= {"tolerance": xi, "stop_residual": square, "stop_passes": passes}
        params = u_phase.params.astype(np.float32)
        u_i = params[self.shared]
        change = params[self.synced] - broadcast
        pi = state.pi if s.freeze_dual else (state.pi + s.rho * change).astype(np.float32)  # (12)
        new = FedApmClientState(params, pi, state.reported_smooth)
        z, z_old = self.message_of(new), self.message_of(state)
        per_tensor, l2 = deviation(self.params, self.shared, u_i, u, segments=self.segments)
        metrics = {
            "train_loss": u_phase.mean_loss,
            "v_train_loss": v_phase.mean_loss,
            "deviation": per_tensor,
            "deviation_l2": l2,
            "dual_change": float(np.linalg.norm(pi - state.pi)),
            "primal_residual": float(np.linalg.norm(change)),
            "dual_norm": float(np.linalg.norm(pi)),
            **stop,
        }
        if theory:
            new = replace(new, xi=xi)
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
        before = state.params[self.synced].astype(np.float64)
        upload = FedApmDiagnosticUpload(
            **{f.name: getattr(upload, f.name) for f in fields(upload)},
            shared_change=synced.astype(np.float64) - before,
            shared_square_change=float(synced.astype(np.float64) @ synced) - float(before @ before),
            tolerance_change=xi - self.tolerance_of(state),
        )
        return ClientUpdate(replace(new, reported_smooth=smooth), upload, metrics)

    def _solve_to_tolerance(
        self,
        phase: SGDResult,
        sgd: FedApmSettings,
        terms: tuple[Term, ...],
        mask: np.ndarray,
        residual: Callable[[np.ndarray, np.ndarray], np.ndarray],
        xi: float,
    ) -> Generator[Request, Result, tuple[SGDResult, float, float]]:
        """The theory's stop rule for one sub-problem: after `phase` (its first E-epoch pass), further passes from
        where the last ended until ||residual(x, grad f_i(x) + mu_wd x)||^2 <= xi (one full-batch gradient after
        each pass), at most `max_passes` passes in all; the last pass's result, the passes and the last square."""
        passes = 1
        while True:
            at = yield from gradient(FullGradient(phase.params, "train"))
            x = np.asarray(phase.params, np.float64)
            square = float(np.sum(residual(x, np.asarray(at.grad, np.float64) + sgd.weight_decay * x) ** 2))
            if square <= xi or passes >= self.settings.max_passes:
                return phase, float(passes), square
            phase = yield from train(sgd.local_sgd(phase.params, terms=terms, mask=mask))
            passes += 1

    def message(self, update: ClientUpdate) -> Vector:
        """z_i of the new state (the message whose change the client uploads)."""
        return self.message_of(update.state)

    def message_of(self, state: FedApmClientState) -> Vector:
        """z_i = u_i + pi_i / rho (13)."""
        return state.params[self.synced].astype(np.float64) + state.pi / self.settings.rho

    def server_step(self, server: FedApmServerState, total: DeltaUpload, num_selected: int):
        shared, metrics = admm_server_step(server.shared, total, num_selected, self.settings.rho)  # (8)
        totals = server.totals
        if isinstance(total, FedApmDiagnosticUpload) and totals is not None:
            totals = TheoryTotals(
                totals.shared_sum + total.shared_change,
                totals.shared_square_sum + float(total.shared_square_change),
                totals.tolerance_sum + float(total.tolerance_change),
            )
            u = shared.w.astype(np.float64)
            m = shared.num_clients
            # sum_i ||u_i - u||^2 = sum_i ||u_i||^2 - 2 <sum_i u_i, u> + m ||u||^2, over all m clients
            square = totals.shared_square_sum - 2 * float(totals.shared_sum @ u) + m * float(u @ u)
            metrics["primal_residual"] = float(np.sqrt(max(square, 0.0)))
            if "lagrangian" in metrics:
                metrics["lyapunov"] = metrics["lagrangian"] + self.settings.lyapunov_weight() * totals.tolerance_sum
        return FedApmServerState(shared, server.template, totals), metrics

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.synced]

    def global_model(self, server: FedApmServerState) -> Vector:
        full = server.template.copy()
        full[self.synced] = server.u
        return full

    def personalized_model(self, state: FedApmClientState) -> Vector:
        return state.params
