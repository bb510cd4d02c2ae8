"""The consensus-ADMM family (FLAME, FedADMM, FedAPM, pFedMe with `aggregation: all`, Lp-Proj): the server's running
mean over all m clients' latest messages, FLAME's update of w_i and pi_i in one compiled pass (`admm_update`, which
Lp-Proj's client step takes too), and the augmented Lagrangian the methods log as diagnostics.

Robust aggregation and Byzantine attacks rewrite the upload field named by `Upload.message_field`
(raysim.threats.robust, raysim.threats.attacks, the coordinator's `_robust_upload`); these helpers read the very same
fields, so the server's mean and the robust rule that replaces it agree on what a message is. Every server step reports
`global_change` = ||w_new - w_old|| (interface.server_metrics).

Running-mean servers (`Upload.delta = True`: FLAME, FedADMM, FedAPM, pFedMe with `aggregation: all`).
The global model is the unweighted mean of the latest messages of ALL m clients, stale ones included:

    w = (1/m) sum_{i=1..m} u_i        FLAME, eq. (14) (u_i = w_i + pi_i/rho; FedADMM: FLAME, eq. (19),
                                      FedAPM: eq. (8) with z_i, pFedMe: FLAME, Sec. IV-E with w_i)

A selected client uploads the change u_i^new - u_i^old (`DeltaUpload`), so the summed upload moves a float64
running sum S = sum_i u_i held by the server (`RunningMeanState`); the model is S / m (divided, not multiplied by
1/m), cast to float32. Before round 0 every client's message is the initial model's (`start_running_mean`), and
the coordinator's robust aggregation starts from the same sum.

## Diagnostics

Convergence diagnostics of the consensus-ADMM methods with a running-mean server (FLAME, FedADMM, FedAPM), opt-in
by their setting `diagnostics: true` (FLAME, Lemma 3; Sec. V; FedAPM, Lemma 1; docs/algorithms.md "ADMM
convergence").

The methods minimize an augmented Lagrangian of the form

    L(P, w) = sum_i [ g_i + c_i(w) ],   c_i(w) = <pi_i, x_i - w> + rho/2 ||x_i - w||^2,

with x_i = w_i, g_i = alpha_i (f_i(theta_i) + lambda/2 ||theta_i - w_i||^2) for FLAME (10); x_i = theta_i,
g_i = alpha_i f_i(theta_i) for FedADMM (FLAME, eq. (19)); x_i = u_i, g_i = alpha_i f_i(v_i, u_i) for FedAPM (4).
The server keeps L over ALL m clients as two running totals (`AdmmTotals`), so it is logged under partial
participation too (an unselected client's g_i and c_i do not change while w stays; only w moves them):

- the smooth parts G = sum_i g_i: a client reports the change of its g_i since its last report (its state keeps
  the last g_i it reported, NaN before its first, when it reports all of g_i), so G is complete once every client
  has reported at least once; `server/lagrangian` is logged from that round on (after round 0 under full
  participation);
- the coupling C(w) = sum_i c_i(w) at the server's current w, which starts at 0 (x_i = w^0, pi_i = 0): a client
  reports c_i(new state, w^t) - c_i(old state, w^t) at the w^t it received, and the server then moves C to the new
  w exactly, C is quadratic in w with Hessian m rho I and gradient -rho (R - m w), R = sum_i (x_i + pi_i / rho)
  the server's running sum of messages (14).

The sum of the duals, sum_i pi_i (zero at a stationary point, (16)), is a running sum over ALL m clients as well:
each selected client adds the change of its pi_i, starting from pi_i^0 = 0.

`server/successive_change` is the sum of squared successive differences the descent lemmas bound: FLAME's
Delta Gamma^{t+1} = sum_i (||w^{t+1} - w^t||^2 + ||w_i^{t+1} - w_i^t||^2 + ||theta_i^{t+1} - theta_i^t||^2)
(Lemma 1, FLAME, Sec. V), FedAPM's Sigma_p^{t+1} = sum_i (||dv_i||^2 + ||du_i||^2 + ||du||^2) (Lemma 1, FedAPM, Lemma
1), FedADMM's sum_i (||dw||^2 + ||dtheta_i||^2): each client reports its own variables' part, the server adds
m ||w^{t+1} - w^t||^2 (an unselected client's variables do not move).

These fields ride in the upload beside the message change (`AdmmDiagnosticUpload`) for the runtime to sum; they
are diagnostics of the simulation, not part of the algorithms' communication: NOT_SENT, so `uplink_bytes` does not
count them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raysim.algorithms.interface import (
    NOT_SENT,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import Number, Vector
from raysim.jit import add_square, kernel, norms


@dataclass
class DeltaUpload(Upload):
    """A running-mean client's upload: the change of its message since its last one, u_i^new - u_i^old."""

    change: Vector

    message_field = "change"
    delta = True


@dataclass
class AdmmTotals:
    """The server's running totals over ALL m clients behind the diagnostics (raysim.algorithms.families.consensus)."""

    dual_sum: np.ndarray
    """float64: sum_i pi_i."""
    smooth_sum: float = 0.0
    """G = sum of the g_i reported so far (each client's latest)."""
    reported: int = 0
    """How many clients have reported at least once."""
    coupling: float = 0.0
    """C(w) = sum_i c_i(w) at the server's current global model."""


@dataclass
class RunningMeanState:
    """A running-mean server's state: the mean of ALL m clients' latest messages and their sum."""

    w: Vector
    """float32: the running sum divided by m, the global model (FedAPM: its shared part u)."""
    running_sum: np.ndarray
    """float64: the sum over all m clients of their latest messages."""
    num_clients: int
    diagnostics: AdmmTotals | None = None
    """The running totals over all m clients behind the ADMM methods' `diagnostics: true`
    (raysim.algorithms.families.consensus); None otherwise."""


def start_running_mean(initial: Vector, num_clients: int) -> RunningMeanState:
    """The state before round 0, when every client's latest message is `initial`, the initial model's message
    coordinates (FLAME: theta_i^0 = w_i^0 = w^0 and pi_i^0 = 0, so u_i^0 = w^0)."""
    return RunningMeanState(initial.copy(), num_clients * initial.astype(np.float64), num_clients)


def running_mean(server: RunningMeanState, total: Upload) -> tuple[RunningMeanState, dict[str, float]]:
    """Add the summed message changes of `total` to the running sum and average over ALL m clients; the new
    state and the server metrics."""
    if not total.delta or total.message_field is None:
        raise TypeError(f"running_mean needs an Upload with delta = True, got {type(total).__name__}")
    new_sum = server.running_sum + getattr(total, total.message_field)
    model = (new_sum / server.num_clients).astype(np.float32)
    return RunningMeanState(model, new_sum, server.num_clients), server_metrics(model, server.w)


@dataclass
class AdmmDiagnosticUpload(DeltaUpload):
    """A running-mean ADMM client's upload with the diagnostics of `diagnostics: true` (not counted as uplink)."""

    dual_change: Vector = field(metadata=NOT_SENT)
    """pi_i^new - pi_i^old: moves the server's running sum of the duals."""
    smooth_change: Number = field(metadata=NOT_SENT)
    """g_i^new - g_i at the client's last report (all of g_i^new at its first): moves G."""
    first_reports: Number = field(metadata=NOT_SENT)
    """1 at the client's first report, else 0: G is complete when m clients have reported."""
    coupling_change: Number = field(metadata=NOT_SENT)
    """c_i(new state, w^t) - c_i(old state, w^t) at the w^t the client received: moves C."""
    step_squared: Number = field(metadata=NOT_SENT)
    """The squared change of the client's primal variables this round: its part of `successive_change`."""


def coupling_term(pi: Vector, x: Vector, w: Vector, rho: float) -> Number:
    """c_i = <pi_i, x_i - w> + rho/2 ||x_i - w||^2 in float64; one per row for a chunk's stacked rows."""
    gap = np.asarray(x, np.float64) - np.asarray(w, np.float64)
    return np.sum(np.asarray(pi, np.float64) * gap + rho / 2 * gap**2, axis=-1)


def diagnostic_upload(
    change: Vector,
    *,
    smooth: Number,
    last_smooth: Number,
    pi: Vector,
    pi_before: Vector,
    x: Vector,
    x_before: Vector,
    w: Vector,
    rho: float,
    step_squared: Number,
) -> AdmmDiagnosticUpload:
    """The upload of a client (or of a chunk's rows) whose state went from (x_before, pi_before) to (x, pi) at the
    received w, with smooth part g_i = `smooth` now and `last_smooth` at its last report (NaN: never reported)."""
    first = np.isnan(last_smooth)
    return AdmmDiagnosticUpload(
        change,
        pi - pi_before,
        np.asarray(smooth, np.float64) - np.where(first, 0.0, last_smooth),
        first.astype(np.float64),
        coupling_term(pi, x, w, rho) - coupling_term(pi_before, x_before, w, rho),
        step_squared,
    )


def squared_change(new: Vector, old: Vector) -> Number:
    """||new - old||^2 in float64; one per row for a chunk's stacked rows."""
    return np.sum((np.asarray(new, np.float64) - np.asarray(old, np.float64)) ** 2, axis=-1)


def row_norms(vectors: Vector) -> Number:
    """||v|| of one vector, or of each row of a chunk's stacked rows (float64 sums, one compiled pass)."""
    return norms(vectors)


def admm_server_step(
    server: RunningMeanState, total: DeltaUpload, num_selected: int, rho: float
) -> tuple[RunningMeanState, dict[str, float]]:
    """The running-mean server step (14); with an `AdmmDiagnosticUpload` also the running totals (`AdmmTotals`)
    and the metrics `dual_sum_norm` = ||sum_i pi_i||, `successive_change` and, once every client has reported,
    `lagrangian` = L(P^{t+1}, w^{t+1})."""
    new, metrics = running_mean(server, total)
    if not isinstance(total, AdmmDiagnosticUpload):
        return new, metrics
    m = server.num_clients
    old = server.diagnostics or AdmmTotals(np.zeros(server.running_sum.shape))
    w_old = server.w.astype(np.float64)
    step = new.w.astype(np.float64) - w_old
    step_squared = float(step @ step)
    gradient = -rho * (new.running_sum - m * w_old)  # of C at w^t, the selected clients' new states in place
    coupling = old.coupling + float(total.coupling_change) + float(gradient @ step) + m * rho / 2 * step_squared
    new.diagnostics = AdmmTotals(
        old.dual_sum + total.dual_change,
        old.smooth_sum + float(total.smooth_change),
        old.reported + round(float(total.first_reports)),
        coupling,
    )
    metrics["dual_sum_norm"] = float(np.linalg.norm(new.diagnostics.dual_sum))
    metrics["successive_change"] = float(total.step_squared) + m * step_squared
    if new.diagnostics.reported == m:
        metrics["lagrangian"] = new.diagnostics.smooth_sum + coupling
    return new, metrics


def paper_update(theta: Any, w_i: Any, pi: Any, w: Any, lam_alpha: Any, rho: Any) -> tuple[Any, Any]:
    """Eqs. (12) and (13) as the paper writes them, in array operators over numpy arrays or torch tensors (one
    client's vectors, or a chunk's rows with `lam_alpha` a column): the new w_i and pi_i, as new arrays. The
    compiled `admm_update` gives exactly their float32 bits (tests/unit/test_flame.py); the tests and benchmarks take
    the paper's form from here.

        w_i  <- (lambda alpha_i theta_i + rho w - pi_i) / (lambda alpha_i + rho)      (12)
        pi_i <- pi_i + rho (w_i - w)                                                (13)
    """
    new_w = (lam_alpha * theta + rho * w - pi) / (lam_alpha + rho)
    return new_w, pi + rho * (new_w - w)


def paper_message(w_i: Any, pi: Any, rho: Any) -> Any:
    """u_i = w_i + pi_i / rho, the message whose mean over all m clients is the global model (14)."""
    return w_i + pi / rho


@kernel
def admm_update(theta, w_i, pi, w, lam_alpha, rho):
    """For every row i (client), eqs. (12) and (13) (`paper_update`), written into w_i and pi (each entry read
    before it is written, one pass).

    Returns the change of the message u_i = w_i + pi_i / rho, ||w_i - w|| (primal residual), the change of pi_i in
    norm (dual change) and ||pi_i - lambda alpha_i (theta_i - w_i)||, Lemma 3's residual (eq. 33: zero in exact
    arithmetic, so it measures rounding). float32 throughout, as numpy."""
    count, n = theta.shape
    delta_u = np.empty_like(theta)
    primal, dual, lemma = np.empty(count), np.empty(count), np.empty(count)
    for i in range(count):
        la = lam_alpha[i]
        primal_sq = dual_sq = lemma_sq = np.float32(0.0)
        for j in range(n):
            pi_old = pi[i, j]
            u_old = w_i[i, j] + pi_old / rho
            w_ij = (la * theta[i, j] + rho * w[j] - pi_old) / (la + rho)
            pi_ij = pi_old + rho * (w_ij - w[j])
            delta_u[i, j] = (w_ij + pi_ij / rho) - u_old
            primal_sq = add_square(primal_sq, w_ij - w[j])
            dual_sq = add_square(dual_sq, pi_ij - pi_old)
            lemma_sq = add_square(lemma_sq, pi_ij - la * (theta[i, j] - w_ij))
            w_i[i, j], pi[i, j] = w_ij, pi_ij
        primal[i], dual[i], lemma[i] = np.sqrt(primal_sq), np.sqrt(dual_sq), np.sqrt(lemma_sq)
    return delta_u, primal, dual, lemma
