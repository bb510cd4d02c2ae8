"""The two server steps that several algorithms share, written once over the `Upload` contract (base.py), with
the uploads, state and start of each family.

Robust aggregation and Byzantine attacks rewrite the upload field named by `Upload.message_field`
(raysim.threats.robust, raysim.threats.attacks, the coordinator's `_robust_upload`); these helpers read the very same
fields, so the server's mean and the robust rule that replaces it agree on what a message is.

Running-mean servers (`Upload.delta = True`: FLAME, FedADMM, FedAPM, pFedMe with `aggregation: all`).
The global model is the unweighted mean of the latest messages of ALL m clients, stale ones included:

    w = (1/m) sum_{i=1..m} u_i        flame.md eq. (14) (u_i = w_i + pi_i/rho; FedADMM flame.md 2.2,
                                      FedAPM fedapm.md eq. (8) with z_i, pFedMe flame.md 2.1 with w_i)

A selected client uploads the change u_i^new - u_i^old (`DeltaUpload`), so the summed upload moves a float64
running sum S = sum_i u_i held by the server (`RunningMeanState`); the model is S / m (divided, not multiplied by
1/m), cast to float32. Before round 0 every client's message is the initial model's (`start_running_mean`), and
the coordinator's robust aggregation starts from the same sum.

Weighted-average servers (`weight_field` set: FedAvg flame.md 2.3, FedProx, Ditto flame.md 2.4, FedAlt and
FedSim fedapm.md 4.3). The global model is the weighted mean of this round's selected clients' messages:

    w = sum_{i in S} a_i x_i / sum_{i in S} a_i

Each client uploads a_i * x_i and a_i (`WeightedUpload`); the runtime sums both exactly.

Both report `global_change` = ||w_new - w_old||, the server metric every algorithm logs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysim.algorithms.interface import Upload
from raysim.algorithms.requests import Number, Vector


@dataclass
class DeltaUpload(Upload):
    """A running-mean client's upload: the change of its message since its last one, u_i^new - u_i^old."""

    change: Vector

    message_field = "change"
    delta = True


@dataclass
class WeightedUpload(Upload):
    """An averaging client's upload: its message times its weight, a_i x_i, and a_i."""

    weighted: Vector
    weight: Number

    message_field = "weighted"
    weight_field = "weight"


@dataclass
class AdmmTotals:
    """The server's running totals over ALL m clients behind the diagnostics (raysim.algorithms.admm_diagnostics)."""

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
    (raysim.algorithms.admm_diagnostics); None otherwise."""


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


def upload_weight(num_train: Number, aggregation: str) -> np.ndarray:
    """A client's weight in a WeightedUpload (float32; one per row of a chunk): its training-set size n_i with
    `aggregation: samples` (McMahan et al.), else 1."""
    samples = np.asarray(num_train, np.float32)
    return samples if aggregation == "samples" else np.ones_like(samples)


def weighted_average(total: Upload, previous: Vector) -> tuple[Vector, dict[str, float]]:
    """sum(weight * message) / sum(weight) over the selected clients (float32), and the server metrics.

    `previous` is the current global model (for `global_change`)."""
    if total.delta or total.message_field is None or total.weight_field is None:
        kind = type(total).__name__
        raise TypeError(f"weighted_average needs an Upload with message_field and weight_field, got {kind}")
    model = (getattr(total, total.message_field) / getattr(total, total.weight_field)).astype(np.float32)
    return model, server_metrics(model, previous)


def server_metrics(model: Vector, previous: Vector) -> dict[str, float]:
    """What every server step logs: how far the global model moved this round."""
    return {"global_change": float(np.linalg.norm(model - previous))}
