"""The dynamic-regularization family: FedDyn's local objective f_i(theta) - <gamma_i, theta> + alpha/2 ||theta - w||^2
and its dual update (Acar et al. 2021), the local solver FedSLR's Phase I takes (FedSLR, eq. (5)) and the PGD
ablations with it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from pydantic import Field

from raysim.algorithms.requests import LocalSGD, Vector
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Linear, Prox


def dynamic_request(settings: SGDSettings, w_t: Vector, gamma: Vector, eta_g: float, lr: float) -> LocalSGD:
    """Local SGD from w_t on f_i(w) - <gamma_i, w> + 1/(2 eta_g) ||w - w_t||^2 at rate `lr` (FedDyn Alg. 1 line 6
    with alpha = 1/eta_g; FedSLR eq. 4)."""
    return dataclasses.replace(settings.local_sgd(w_t, terms=(Prox(w_t, 1.0 / eta_g), Linear(-gamma))), lr=lr)


def dual_update(gamma: Vector, w_t: Vector, w_i: Vector, eta_g: float) -> Vector:
    """gamma_i + (w_t - w_i) / eta_g (FedDyn Alg. 1 line 7; FedSLR eq. 5), float32; it equals grad f_i(w_i) after
    an exact local solve (FedSLR eq. 25)."""
    return (gamma + (w_t - w_i) / eta_g).astype(np.float32)


def mirrored_dual_mean(
    gamma_mean: np.ndarray, w_t: Vector, summed: np.ndarray, num_selected: int, eta_g: float, num_clients: int
) -> np.ndarray:
    """The mean over all m clients of their duals after a round in which only the selected ones changed theirs, by
    (w_t - w_i)/eta_g each, from the sum of their w_i: FedDyn's h (Alg. 1 line 9), FedSLR's gamma-bar (Alg. 3)."""
    w = w_t.astype(np.float64)
    return gamma_mean + (num_selected * w - summed) / (eta_g * num_clients)


def dual_corrected_mean(summed: np.ndarray, count: float, gamma_mean: np.ndarray, eta_g: float) -> np.ndarray:
    """mean_S w_i - eta_g gamma-bar (float64): FedDyn's theta^t (Alg. 1 line 10), FedSLR's point before its prox
    (eq. 6)."""
    return summed / count - eta_g * gamma_mean


class DynamicSolverSettings(SGDSettings):
    """FedSLR's local solver (FedSLR, App. B), the defaults of FedSLR, FedDyn, GPGD and LPGD: 2 local epochs at batch
    20 and eta_l = 0.1, decayed by 0.998 every round (LrSchedule: a client step of round t reads eta_l^(t) as lr)."""

    epochs: int = Field(2, ge=1, description="local epochs (2 in FedSLR's comparison, FedSLR, App. B)")
    lr: float = Field(0.1, gt=0, description="eta_l: local learning rate at round 0")
    batch_size: int = Field(20, ge=1, description="samples of each mini-batch of local SGD (20 in FedSLR's setup)")
    lr_decay: float = Field(0.998, gt=0, le=1, description="eta_l^(t) = lr * lr_decay^t (FedSLR, App. B)")
