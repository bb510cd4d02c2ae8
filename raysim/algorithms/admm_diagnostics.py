"""Convergence diagnostics of the consensus-ADMM methods with a running-mean server (FLAME, FedADMM), opt-in by
their setting `diagnostics: true` (flame.md 1.6, 5 and 9 item 14; docs/algorithms.md "ADMM convergence").

Both methods minimize an augmented Lagrangian of the form

    L(P) = sum_i [ g_i(theta_i, w_i) + <pi_i, x_i - w> + rho/2 ||x_i - w||^2 ]

with x_i = w_i, g_i = alpha_i (f_i(theta_i) + lambda/2 ||theta_i - w_i||^2) for FLAME (10), and x_i = theta_i,
g_i = alpha_i f_i(theta_i) for FedADMM (flame.md 2.2). The server's step w = (1/m) sum_i (x_i + pi_i / rho) ((14))
minimizes L over w exactly, and L is quadratic in w with Hessian m rho I, so for any w'

    L(Theta, X, Pi, w') = L(Theta, X, Pi, w_new) + (m rho / 2) ||w' - w_new||^2.

A selected client therefore reports its term L_i at the w it received (it does not know the new one); when every
one of the m clients reported in a round (full participation), the server gets L(P^{t+1}) at the new global model
by subtracting (m rho / 2) ||w_new - w^t||^2 from their sum (`lagrangian` below). Under partial participation the
unselected clients' terms move with w and are not at the server, so the Lagrangian is not logged.

The sum of the duals, sum_i pi_i (zero at a stationary point, (16)), is a running sum over ALL m clients: each
selected client adds the change of its pi_i, starting from pi_i^0 = 0.

These two fields ride in the upload beside the message change (`AdmmDiagnosticUpload`) for the runtime to sum; they
are diagnostics of the simulation, not part of the algorithms' communication: NOT_SENT, so `uplink_bytes` does not
count them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raysim.algorithms.base import NOT_SENT, Number, Vector
from raysim.algorithms.servers import DeltaUpload, RunningMeanState, running_mean


@dataclass
class AdmmDiagnosticUpload(DeltaUpload):
    """A running-mean ADMM client's upload with the diagnostics of `diagnostics: true` (not counted as uplink)."""

    dual_change: Vector = field(metadata=NOT_SENT)
    """pi_i^new - pi_i^old: moves the server's running sum of the duals."""
    lagrangian: Number = field(metadata=NOT_SENT)
    """L_i(theta_i^new, x_i^new, pi_i^new, w^t), the client's term of the augmented Lagrangian at the w it received."""


def lagrangian_term(smooth: Number, pi: Vector, x: Vector, w: Vector, rho: float) -> Number:
    """L_i = smooth + <pi_i, x_i - w> + rho/2 ||x_i - w||^2 in float64; one per row for a chunk's stacked rows.
    `smooth` is g_i (the client's part without the constraint terms)."""
    gap = np.asarray(x, np.float64) - np.asarray(w, np.float64)
    return np.asarray(smooth, np.float64) + np.sum(np.asarray(pi, np.float64) * gap + rho / 2 * gap**2, axis=-1)


def row_norms(vectors: Vector) -> Number:
    """||v|| of one vector, or of each row of a chunk's stacked rows."""
    return np.linalg.norm(np.asarray(vectors, np.float64), axis=-1)


def admm_server_step(
    server: RunningMeanState, total: DeltaUpload, num_selected: int, rho: float
) -> tuple[RunningMeanState, dict[str, float]]:
    """The running-mean server step (14); with an `AdmmDiagnosticUpload` also the running dual sum and the
    metrics `dual_sum_norm` = ||sum_i pi_i|| and, when all m clients reported, `lagrangian` = L(P^{t+1})."""
    new, metrics = running_mean(server, total)
    if not isinstance(total, AdmmDiagnosticUpload):
        return new, metrics
    previous = np.zeros(server.running_sum.shape) if server.dual_sum is None else server.dual_sum
    new.dual_sum = previous + total.dual_change
    metrics["dual_sum_norm"] = float(np.linalg.norm(new.dual_sum))
    if num_selected == server.num_clients:
        exact_mean = new.running_sum / server.num_clients  # the minimizer over w, before rounding to float32
        shift = float(np.sum((exact_mean - server.w.astype(np.float64)) ** 2))
        metrics["lagrangian"] = float(total.lagrangian) - server.num_clients * rho / 2 * shift
    return new, metrics
