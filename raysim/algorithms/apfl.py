"""APFL: Adaptive Personalized Federated Learning (Deng, Kamani, Mahdavi, 2020, arXiv:2003.13461). A baseline of
FedSLR's Table 1 (FedSLR, App. B.2: mixing parameter 0.5).

Client i keeps a local model v_i and a mixing weight alpha_i; its personalized model is the mixture
v_bar_i = alpha_i v_i + (1 - alpha_i) w. A selected client starts its copy of the global model from the received w
and runs `local_steps` steps (default: about `epochs` passes, `batch_steps`), each on one fresh batch xi
(BatchGradients, both gradients on the same batch):

    w   <- w - eta grad f_i(w; xi)                                          (Algorithm 1, line 6)
    v_i <- v_i - eta grad_v f_i(v_bar; xi) = v_i - eta alpha_i grad f_i(v_bar; xi)   (line 7)
    v_bar = alpha_i v_i + (1 - alpha_i) w        (both at the step's start)
    alpha_i <- clip(alpha_i - eta_alpha <v_i - w, grad f_i(v_bar; xi)>, 0, 1)        (eq. 10, `adaptive_alpha`)

and sends w; the server averages the copies as FedAvg (by training-set size, or uniformly). alpha_i stays fixed
(0.5, FedSLR's setting) unless `adaptive_alpha`. With alpha = 0 the w path is FedAvg with one-batch steps and the
PM is the GM; with alpha = 1, v_i is plain local training.

Evaluated PM: alpha_i v_i + (1 - alpha_i) w with w the current global model (the paper's personalized model, v_bar
with the server's w). Communication: the model each way (w only). FedSLR's "APFL 22.35M (2 models)" (FedSLR,
Table 2) counts parameters a client holds (v_i and w), not traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.requests import BatchGradients, Number, Vector, batch_gradients, mean_over_steps
from raysim.algorithms.settings import LocalStepsSettings
from raysim.jit import distances


class ApflSettings(LocalStepsSettings):
    name: Literal["apfl"] = "apfl"
    alpha: float = Field(0.5, ge=0, le=1, description="the mixing weight alpha_i at the start (FedSLR, App. B.2: 0.5)")
    adaptive_alpha: bool = Field(False, description="update alpha_i by its gradient each step (eq. 10)")
    alpha_lr: float | None = Field(None, gt=0, description="eta_alpha of the adaptive update (default: lr)")
    lr: float = Field(0.01, gt=0, description="eta: the learning rate of w and v_i")
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr", "alpha_lr")
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weight the global-model copies by training-set size (as FedAvg) or equally"
    )


@dataclass
class ApflClientState:
    v: Vector
    """The local model v_i."""
    alpha: Number
    """The mixing weight alpha_i."""


@dataclass
class ApflServerState:
    w: Vector


def mixture(v: np.ndarray, w: np.ndarray, alpha: Number) -> np.ndarray:
    """v_bar = alpha v + (1 - alpha) w (alpha a number, or a column of one per row)."""
    a = _column(alpha)
    return (a * v + (np.float32(1) - a) * w).astype(np.float32)


def _column(alpha: Number) -> np.ndarray:
    """alpha as float32 scaling a vector, or each row of a chunk's [k, n] arrays."""
    return per_row(alpha) if np.ndim(alpha) else np.float32(alpha)


def alpha_gradient(v: np.ndarray, w: np.ndarray, mixed_gradient: np.ndarray) -> np.ndarray:
    """d/d alpha f(alpha v + (1 - alpha) w) = <v - w, grad f(v_bar)> (eq. 10), per row."""
    return np.sum((v.astype(np.float64) - w) * mixed_gradient, axis=-1)


@ALGORITHMS.register()
class Apfl(Algorithm[ApflSettings, ApflClientState, ApflServerState, Vector, WeightedUpload]):
    name = "apfl"
    Settings = ApflSettings
    Upload = WeightedUpload
    stacks = True

    def init_server(self, init_params: Vector, num_clients: int) -> ApflServerState:
        return ApflServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> ApflClientState:
        return ApflClientState(init_params, float(self.settings.alpha))  # v shared, read-only until replaced

    def broadcast(self, server: ApflServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo | ClientChunk, state: ApflClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        eta = np.float32(s.lr)
        eta_alpha = s.lr if s.alpha_lr is None else s.alpha_lr
        steps = s.step_counts(client.num_train)
        v = np.array(state.v, np.float32)
        w = np.array(np.broadcast_to(broadcast, v.shape), np.float32)
        alpha = np.array(state.alpha, np.float64)
        global_losses, personal_losses = [], []
        for step in range(int(steps.max(initial=0))):
            active = step < steps
            mixed = mixture(v, w, alpha)
            result = yield from batch_gradients(BatchGradients(np.stack([w, mixed], axis=-2), s.batch_size))
            grad_w, grad_mixed = result.grads[..., 0, :], result.grads[..., 1, :]
            moved_w = w - eta * grad_w  # Algorithm 1, line 6
            moved_v = v - eta * _column(alpha) * grad_mixed  # line 7: grad_v f(v_bar) = alpha grad f(v_bar)
            if s.adaptive_alpha:  # eq. (10), with v and w of the step's start
                alpha = np.where(active, np.clip(alpha - eta_alpha * alpha_gradient(v, w, grad_mixed), 0.0, 1.0), alpha)
            keep = np.asarray(active)[..., None]
            w, v = np.where(keep, moved_w, w), np.where(keep, moved_v, v)
            global_losses.append(result.losses[..., 0])
            personal_losses.append(result.losses[..., 1])
        metrics = {
            "train_loss": mean_over_steps(global_losses, steps),
            "personal_train_loss": mean_over_steps(personal_losses, steps),
            "alpha": alpha,
            "update_norm": distances(w, broadcast),
        }
        weight = upload_weight(client.num_train, s.aggregation)
        upload = WeightedUpload(per_row(weight) * w.astype(np.float64), weight)
        new_alpha = alpha if alpha.ndim else float(alpha)
        return ClientUpdate(ApflClientState(v.astype(np.float32), new_alpha), upload, metrics)

    def server_step(self, server: ApflServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)
        return ApflServerState(w), metrics

    def global_model(self, server: ApflServerState) -> Vector:
        return server.w

    def evaluated_model(self, state: ApflClientState, global_params: Vector) -> Vector:
        """The personalized model alpha_i v_i + (1 - alpha_i) w with the current global model w."""
        return mixture(np.asarray(state.v), global_params, float(state.alpha))
