"""FedSLR: low-rank global knowledge + sparse personal components, nuclear-norm prox on the server (FedSLR, Alg. 1).

A selected client i, given the global knowledge representation (GKR) w_t and round t, runs

    Phase I   w_i     <- SGD on f_i(w) - <gamma_i, w> + 1/(2 eta_g) ||w - w_t||^2, from w_t      (4)
              gamma_i <- gamma_i + (w_t - w_i) / eta_g                                         (5)
    Phase II  p_i     <- proximal SGD on f_i(w_t + p) + mu ||p||_1, warm-started from its last p  (7)

at local rate eta_l * decay^t, and uploads only w_i. The server mirrors the duals as their mean over all
M clients (Alg. 3 in its partial-participation form, FedSLR, Alg. 3, App. A.5; gamma is never sent) and sets

    w_{t+1} = Prox_{lambda eta_g ||.||_*}( mean_{S_t} w_i - eta_g mean_M gamma_i )               (6), Alg. 2

layer-wise (SVT of linear and matrixized conv weights; biases and norm parameters pass unchanged). The
SVD's thresholded factors U sqrt(S), sqrt(S) V^T are the downlink (FedSLR, Alg. 1 line 3): `downlink_bytes`
counts min(dense, factored) per layer. Phase I, the dual update and the server's mean before the prox are FedDyn's
(alpha = 1/eta_g), written once in raysim.algorithms.feddyn; with lambda = mu = 0 FedSLR's w_t is FedDyn's theta.
With `phase_timing: true` each phase's wall time (the authors' code prints Phase I's) is
`update/phase1_seconds` and `update/phase2_seconds`: from the step's request to its result (in a vectorized chunk,
the chunk's training).
Evaluation scores GM = w, PM = the mixed model w + p_i and `personal` = p_i alone (`extra_models`); the
parameter counts of FedSLR, Table 2 are `server/global_params` and the per-client `update/mixed_params`.

Convergence (docs/algorithms.md, ADMM convergence): every step reports the primal residual ||w_i - w_t||, the dual
change and norm ||gamma_i||, the server ||sum_i gamma_i|| (M times its mirrored mean: free); with `diagnostics: true`
one more full pass gives Phase II's gradient mapping (Thm 3)
G(w_t, p_i) = (p_i - Prox_{mu eta_l ||.||_1}(p_i - eta_l grad_2 f_i(w_t + p_i))) / eta_l at the new p_i, and
another f_i(w_i) for the potential (Def. 1, eq. 10) of Phase I's convergence analysis, logged as `server/potential`
in rounds where all M clients report (the analysis's full participation):

    D_{eta_g}(x, {y_i}, {gamma_i}) = (1/M) sum_i [f_i(y_i) + <gamma_i, x - y_i> + 1/(2 eta_g) ||x - y_i||^2] + R(x)

at x = w_{t+1}, y_i = w_{i,t+1}, gamma_i = gamma_{i,t+1}, R(x) = lambda sum_l ||X_l||_*. Each client sends f_i(w_i),
<gamma_i, w_i> and ||w_i||^2 beside w_i (not counted as uplink); the server has sum_i w_i, sum_i gamma_i = M times
its mirror and the nuclear norms of its prox, and expands the squares. Its Lemma 3: non-increasing when
eta_g <= 1/(2L) and Phase I is solved exactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.dynamic import (
    DynamicSolverSettings,
    dual_corrected_mean,
    dual_update,
    dynamic_request,
    mirrored_dual_mean,
)
from raysim.algorithms.families.lowrank import LowRankBroadcast, LowRankProx, LowRankUpload
from raysim.algorithms.interface import ALGORITHMS, NOT_SENT, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.prox import (
    FactoredModel,
)
from raysim.algorithms.requests import FullGradient, Number, Vector, gradient, train
from raysim.algorithms.terms import L1, Offset
from raysim.models.spec import ParamSpec


class FedSlrSettings(DynamicSolverSettings):
    name: Literal["fedslr"] = "fedslr"
    epochs: int = Field(2, ge=1, description="Phase I local epochs (2 in the paper's experiments)")
    phase2_epochs: int = Field(1, ge=0, description="Phase II local epochs (1 in the paper); 0 skips Phase II")
    lam: float = Field(1e-4, ge=0, alias="lambda", description="lambda: nuclear-norm (low-rank) penalty")
    mu: float = Field(1e-3, ge=0, description="mu: L1 (sparsity) penalty of the personal component")
    eta_g: float = Field(10.0, gt=0, description="eta_g: proximal step; SVT threshold is lambda * eta_g")
    p_init: Literal["zero", "init"] = Field(
        "zero",
        description="p_i^0: zeros (paper silent) or a copy of the initial weights and biases of every conv and "
        "linear layer, normalization parameters zero (authors' code: MaskedConv/MaskedLinear p and p_bias)",
    )
    p_weight_decay: float = Field(0.0, ge=0, description="extra L2 on p in Phase II (1e-3 in the authors' code)")
    l1_scope: Literal["all", "matrices"] = Field(
        "all", description="which entries of p the L1 term covers: all (paper, code) or only matrix weights"
    )
    eval_pairing: Literal["received", "latest"] = Field(
        "received",
        description="mixed model evaluated as w_t + p_i with the w_t p_i was fitted to (eq. 3), or the newest "
        "global model + p_i (authors' code)",
    )
    svd_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the server SVD runs: auto = cuda if the coordinator has a GPU, else cpu"
    )
    diagnostics: bool = Field(
        False,
        description="two more full passes per client, for Phase II's gradient mapping (Thm 3) and the potential "
        "(Def. 1) (docs/algorithms.md, ADMM convergence)",
    )
    phase_timing: bool = Field(
        False,
        description="log each selected client's Phase I and Phase II wall time (update/phase1_seconds, "
        "update/phase2_seconds; the authors' code prints Phase I's); off by default, since timings differ run to run "
        "and the metrics would no longer repeat bit for bit",
    )
    server_duals: Literal["running_mean", "per_client"] = Field(
        "running_mean",
        description="how the server mirrors the duals: their running mean over all M clients (Alg. 3, one model-sized "
        "vector) or every client's gamma_i (Alg. 1/2, M of them; the hosts then send each client's w_i by id); "
        "the same global iterates (FedSLR, Alg. 3, App. A.5)",
    )


@dataclass
class FedSlrClientState:
    gamma: Vector
    """gamma_i, the client's dual (tends to grad f_i(w_i), FedSLR, eq. (25))."""
    p: Vector
    """p_i, the sparse personal component."""
    w: Vector | None
    """The GKR p_i was last fitted to (kept for eval_pairing = received)."""


@dataclass
class FedSlrServerState:
    w: Vector
    """The GKR, = model.params: exactly what the clients rebuild from the downlink."""
    model: FactoredModel
    """The GKR as sent: low-rank layers as the factors of the server's SVD (FedSLR, Alg. 1 line 3)."""
    gamma_mean: np.ndarray
    """float64 mean over all M clients of their mirrored gamma_i."""
    gammas: np.ndarray | None
    """server_duals = per_client: every client's mirrored gamma_i (M x d, float32, Alg. 1/2); None: running_mean."""
    ranks: dict[str, int]
    num_clients: int


@dataclass
class FedSlrDiagnosticUpload(LowRankUpload):
    """With `diagnostics: true`: a client's terms of the potential (Def. 1, eq. 10), not counted as uplink."""

    loss: Number = field(default=0.0, metadata=NOT_SENT)
    """f_i(w_i), the full-batch training loss at Phase I's solution."""
    gamma_dot_w: Number = field(default=0.0, metadata=NOT_SENT)
    """<gamma_{i,t+1}, w_i>."""
    w_squared: Number = field(default=0.0, metadata=NOT_SENT)
    """||w_i||^2."""


MAX_LAYER_SPARSITY_METRICS = 32
"""Per-layer sparsity of p_i is logged for models with at most this many matrix layers (ResNet-18: 21)."""


@ALGORITHMS.register()
class FedSlr(Algorithm[FedSlrSettings, FedSlrClientState, FedSlrServerState, LowRankBroadcast, LowRankUpload]):
    name = "fedslr"
    Settings = FedSlrSettings
    Upload = LowRankUpload

    def __init__(self, settings: FedSlrSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.low_rank = LowRankProx(params, settings.svd_device)

    def _layer_coordinates(self) -> np.ndarray:
        """Boolean mask of the entries of the conv and linear layers: their matrix (>= 2-D) weights and the bias
        beside each (`X.bias` next to a matrix `X.weight`); normalization layers' 1-D weights and biases are out."""
        mask = self._matrix_coordinates()
        shapes = dict(zip(self.params.names, self.params.shapes, strict=True))
        for name in self.params.names:
            module, _, part = name.rpartition(".")
            if part == "bias" and len(shapes.get(f"{module}.weight", ())) >= 2:
                mask[self.params.slice(name)] = True
        return mask

    def _matrix_coordinates(self) -> np.ndarray:
        """Boolean mask of the entries that belong to matrix (>= 2-D) parameters."""
        mask = np.zeros(self.params.size, dtype=bool)
        for name, shape in zip(self.params.names, self.params.shapes, strict=True):
            if len(shape) >= 2:
                mask[self.params.slice(name)] = True
        return mask

    def init_server(self, init_params: Vector, num_clients: int) -> FedSlrServerState:
        # gamma_{i,0} = 0 (authors' code); w_0 is sent dense, so its ranks count as full.
        zeros = np.zeros(init_params.shape, dtype=np.float64)
        w = np.asarray(init_params, dtype=np.float32)
        gammas = None
        if self.settings.server_duals == "per_client":
            gammas = np.zeros((num_clients, *init_params.shape), dtype=np.float32)
        model = FactoredModel.of_dense(w)
        return FedSlrServerState(w.copy(), model, zeros, gammas, self.low_rank.full_ranks(), num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedSlrClientState:
        p = np.zeros_like(init_params)
        if self.settings.p_init == "init":  # the authors' p = copy(w), p_bias = copy(bias); GroupNorm's p = 0
            layers = self._layer_coordinates()
            p[layers] = init_params[layers]
        return FedSlrClientState(np.zeros_like(init_params), p, None)

    def broadcast(self, server: FedSlrServerState) -> LowRankBroadcast:
        return LowRankBroadcast(server.model, server.ranks)

    def client_step(self, client: ClientInfo, state: FedSlrClientState, broadcast: LowRankBroadcast) -> ClientStep:
        s = self.settings
        w_t = broadcast.model.params(self.params)
        lr = s.lr  # eta_l * decay^t: the runtime steps round t with its settings (LrSchedule.at_round)
        started = time.perf_counter()
        result = yield from train(dynamic_request(s, w_t, state.gamma, s.eta_g, lr))  # (4), FedDyn's client step
        phase1_seconds = time.perf_counter() - started
        w_i = result.params
        gamma = dual_update(state.gamma, w_t, w_i, s.eta_g)  # (5)
        metrics = {
            "phase1_loss": result.mean_loss,
            "primal_residual": float(np.linalg.norm(w_i - w_t)),
            "dual_change": float(np.linalg.norm(gamma - state.gamma)),
            "dual_norm": float(np.linalg.norm(gamma)),
        }
        if s.phase_timing:
            metrics["phase1_seconds"] = phase1_seconds
        p = state.p
        l1 = s.mu if s.l1_scope == "all" else s.mu * self._matrix_coordinates().astype(np.float32)
        if s.phase2_epochs:
            phase2 = dataclasses.replace(
                s.local_sgd(p, s.phase2_epochs, terms=(Offset(w_t), L1(l1))), lr=lr, weight_decay=s.p_weight_decay
            )
            started = time.perf_counter()
            second = yield from train(phase2)  # (7)
            if s.phase_timing:
                metrics["phase2_seconds"] = time.perf_counter() - started
            p = second.params
            metrics["phase2_loss"] = second.mean_loss
        if s.diagnostics:  # Thm 3's gradient mapping of (7) at the new p_i, Phase II's stationarity residual
            at_mixed = yield from gradient(FullGradient(w_t + p, "train"))
            step = np.asarray(p, np.float64) - lr * at_mixed.grad
            prox = np.sign(step) * np.maximum(np.abs(step) - lr * np.asarray(l1, np.float64), 0.0)
            metrics["stationarity"] = float(np.linalg.norm(p - prox)) / lr
        nonzeros = float(np.count_nonzero(p))
        mixed = self.global_parameter_count(broadcast.ranks) + nonzeros  # FedSLR, Table 2: GKR + nnz(p_i)
        metrics |= {"p_nonzeros": nonzeros, "p_density": nonzeros / p.size, "mixed_params": mixed, "lr": lr}
        metrics |= self.layer_sparsity(p)
        received = w_t.copy() if s.eval_pairing == "received" else None
        new = FedSlrClientState(gamma, p.astype(np.float32), received)
        sent = w_i.astype(np.float32)
        if not s.diagnostics:
            return ClientUpdate(new, LowRankUpload(sent), metrics)
        at_local = yield from gradient(FullGradient(sent, "train"))  # f_i(w_i) for the potential
        y = sent.astype(np.float64)
        gamma_dot_w = float(np.asarray(gamma, np.float64) @ y)
        upload = FedSlrDiagnosticUpload(sent, 1.0, float(at_local.loss), gamma_dot_w, float(y @ y))
        return ClientUpdate(new, upload, metrics)

    @classmethod
    def reads_messages(cls, settings: FedSlrSettings) -> bool:
        """Per-client mirrors update each gamma_i from that client's own w_i (Alg. 1 line 6)."""
        return settings.server_duals == "per_client"

    def layer_sparsity(self, p: Vector) -> dict[str, float]:
        """`p_sparsity/<layer>`: the share of zero entries of p_i in each matrix layer (FedSLR, Table 4), for
        models of at most MAX_LAYER_SPARSITY_METRICS matrix layers (beyond, `p_density` alone)."""
        layers = [name for name, shape in zip(self.params.names, self.params.shapes, strict=True) if len(shape) >= 2]
        if len(layers) > MAX_LAYER_SPARSITY_METRICS:
            return {}
        return {f"p_sparsity/{name}": float(np.mean(p[self.params.slice(name)] == 0)) for name in layers}

    def model_tables(self, global_params: Vector) -> dict[str, dict[str, list]]:
        """`spectra`: the singular values of every layer of the final GKR (LowRankProx.spectra_table)."""
        return self.low_rank.spectra_table(global_params)

    def server_step(self, server: FedSlrServerState, total: LowRankUpload, num_selected: int):
        """Alg. 3 in its partial-participation form: only the selected clients' gamma_i changed, by
        (w_t - w_i)/eta_g each, so the mean over all M moves by their sum / M (FedSLR, Alg. 3, App. A.5; FedDyn's h)."""
        s = self.settings
        if server.gammas is not None:
            raise ValueError("FedSLR with server_duals = per_client steps through server_step_by_client")
        summed = np.asarray(total.w, dtype=np.float64)
        gamma_mean = mirrored_dual_mean(server.gamma_mean, server.w, summed, num_selected, s.eta_g, server.num_clients)
        return self._prox_step(server, total, num_selected, gamma_mean, None)

    def server_step_by_client(
        self, server: FedSlrServerState, total: LowRankUpload, num_selected: int, messages: Mapping[int, Vector]
    ):
        """Alg. 1/2: the server mirrors each selected client's gamma_i + (w_t - w_i)/eta_g (line 6, the client's own
        float32 update of eq. 5, so mirror and client agree bit for bit) and averages all M mirrors, stale ones
        included (Alg. 2 line 9)."""
        if server.gammas is None:
            return self.server_step(server, total, num_selected)
        gammas = server.gammas.copy()
        for client, w_i in messages.items():
            gammas[client] = dual_update(gammas[client], server.w, np.asarray(w_i, np.float32), self.settings.eta_g)
        gamma_mean = np.asarray(np.sum(gammas, axis=0, dtype=np.float64) / server.num_clients)
        return self._prox_step(server, total, num_selected, gamma_mean, gammas)

    def _prox_step(
        self,
        server: FedSlrServerState,
        total: LowRankUpload,
        num_selected: int,
        gamma_mean: np.ndarray,
        gammas: np.ndarray | None,
    ) -> tuple[FedSlrServerState, dict[str, float]]:
        """w_{t+1} = Prox(mean_S w_i - eta_g gamma-bar) (6) and the server's metrics."""
        s = self.settings
        before = dual_corrected_mean(np.asarray(total.w, np.float64), float(total.count), gamma_mean, s.eta_g)
        prox, metrics = self.low_rank(before, s.lam * s.eta_g, server.w)  # (6)
        metrics["gamma_mean_norm"] = float(np.linalg.norm(gamma_mean))
        metrics["dual_sum_norm"] = server.num_clients * metrics["gamma_mean_norm"]  # ||sum_i gamma_i||, all M
        if isinstance(total, FedSlrDiagnosticUpload) and num_selected == server.num_clients:
            metrics["potential"] = self.potential(total, prox.params, gamma_mean, metrics["nuclear_norm"])
        new = FedSlrServerState(prox.params, prox.model, gamma_mean, gammas, prox.ranks, server.num_clients)
        return new, metrics

    def potential(self, total: FedSlrDiagnosticUpload, x: Vector, gamma_mean: np.ndarray, nuclear_norm: float) -> float:
        """D_{eta_g} (Def. 1, eq. 10) at the new global model x from the M clients' summed terms, the squares
        expanded: sum_i ||x - y_i||^2 = M ||x||^2 - 2 <x, sum_i y_i> + sum_i ||y_i||^2."""
        m, x = total.count, np.asarray(x, np.float64)
        squares = m * (x @ x) - 2 * (x @ np.asarray(total.w, np.float64)) + float(total.w_squared)
        coupling = m * (gamma_mean @ x) - float(total.gamma_dot_w) + squares / (2 * self.settings.eta_g)
        return float((float(total.loss) + coupling) / m + self.settings.lam * nuclear_norm)

    def global_parameter_count(self, ranks: dict[str, int]) -> int:
        """#params of the GKR (FedSLR, Table 2): see LowRankProx.parameter_count."""
        return self.low_rank.parameter_count(ranks)

    def downlink_bytes(self, broadcast: LowRankBroadcast) -> int:
        """What is sent: the GKR's dense layers and factors (FedSLR, Alg. 1 line 3), plus the round t (the clients' rate
        decay), as float32."""
        return 4 * (broadcast.model.size + 1)

    def global_model(self, server: FedSlrServerState) -> Vector:
        return server.w

    def personalized_model(self, state: FedSlrClientState) -> Vector | None:
        return None if state.w is None else state.w + state.p

    def evaluated_model(self, state: FedSlrClientState, global_params: Vector) -> Vector:
        """The mixed model w + p_i (eq. 3), paired as `eval_pairing` says."""
        w = global_params if self.settings.eval_pairing == "latest" or state.w is None else state.w
        return w + state.p

    def extra_models(
        self, state: FedSlrClientState, global_params: Vector, context: object = None
    ) -> dict[str, Vector]:
        """`personal`: p_i alone, the pure personal component (FedSLR, App. B.3.3, Table 7 reports its accuracy)."""
        return {"personal": state.p}
