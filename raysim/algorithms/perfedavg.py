"""Per-FedAvg: FedAvg on the MAML objective F_i(w) = f_i(w - alpha grad f_i(w)) (Fallah, Mokhtari, Ozdaglar,
"Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS
2020, arXiv:2002.07948). A baseline of FedSLR's Table 1 (FedSLR, App. B.2: alpha = 0.01, beta = 0.001) and of
AugFL's Table II (AugFL, Sec. VI; Table II: with the same one-step adaptation at test).

A selected client starts from the received w and runs `local_steps` steps (default: about `epochs` passes over its
training split, FL-bench's count, `batch_steps`), each on fresh independent batches D, D', D'' (BatchGradients):

    temp = w - alpha grad f_i(w; D)                                    (Algorithm 1, line 6; eq. 8)
    FO:  w <- w - beta grad f_i(temp; D')                              (the first-order approximation, Sec. 5)
    HF:  w <- w - beta (I - alpha d_i) grad f_i(temp; D'),             (eq. 9, Per-FedAvg (HF))
         d_i = [grad f_i(w + delta g; D'') - grad f_i(w - delta g; D'')] / (2 delta), g = grad f_i(temp; D'),
         the finite-difference Hessian-vector product

and sends w back; the server averages them as FedAvg (by training-set size, or uniformly). With alpha = 0 each
step is an SGD step of lr beta, FedAvg's. beta is the setting `lr` (the local learning rate, as every method's).

The personalized model is one step of gradient descent with lr alpha from the global model on the client's whole
training split (the adaptation the MAML objective prepares, AugFL's protocol for Per-FedAvg, AugFL, Sec. VI): a
held-out client adapts the current global model at each evaluation (`adapt`); a training client keeps the
adaptation of the global model it last received (computed at the start of its step), so its PM lags the logged GM
by the rounds since it last trained. Communication: the model both ways, as FedAvg.

The step is written over stacked rows (`stacks`): every request is one batched gradient for a chunk's clients; a
client whose split gives it fewer steps keeps its model once they are done.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.interface import (
    ALGORITHMS,
    AdaptStep,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.requests import (
    BatchGradients,
    FullGradient,
    Number,
    Request,
    Result,
    Vector,
    batch_gradients,
    gradient,
    mean_over_steps,
)
from raysim.algorithms.settings import LocalStepsSettings
from raysim.jit import distances


class PerFedAvgSettings(LocalStepsSettings):
    name: Literal["perfedavg"] = "perfedavg"
    alpha: float = Field(0.01, ge=0, description="alpha: the adaptation step size (FedSLR, App. B.2: 0.01)")
    lr: float = Field(0.001, gt=0, description="beta: the meta (local) learning rate (FedSLR, App. B.2: 0.001)")
    hessian: Literal["first_order", "finite_difference"] = Field(
        "first_order",
        description="Per-FedAvg (FO), or (HF): the Hessian-vector product by finite differences on a third batch",
    )
    delta: float = Field(0.001, gt=0, description="HF: the finite-difference step delta")
    batch_size: int = Field(100, ge=1, description="samples of each of a step's batches D, D' (and D'')")
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weight local models by training-set size (as FedAvg) or equally"
    )


@dataclass
class PerFedAvgClientState:
    personal: Vector
    """The PM: one gradient step of lr alpha on the training split from the global model last received."""


@dataclass
class PerFedAvgServerState:
    w: Vector


@ALGORITHMS.register()
class PerFedAvg(Algorithm[PerFedAvgSettings, PerFedAvgClientState, PerFedAvgServerState, Vector, WeightedUpload]):
    name = "perfedavg"
    Settings = PerFedAvgSettings
    Upload = WeightedUpload
    stacks = True

    def init_server(self, init_params: Vector, num_clients: int) -> PerFedAvgServerState:
        return PerFedAvgServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> PerFedAvgClientState:
        return PerFedAvgClientState(init_params)  # shared and read-only until the first step replaces it

    def broadcast(self, server: PerFedAvgServerState) -> Vector:
        return server.w

    def client_step(
        self, client: ClientInfo | ClientChunk, state: PerFedAvgClientState, broadcast: Vector
    ) -> ClientStep:
        s = self.settings
        adaptation = yield from gradient(FullGradient(broadcast, "train"))
        personal = (broadcast - np.float32(s.alpha) * adaptation.grad).astype(np.float32)
        steps = s.step_counts(client.num_train, 3 if s.hessian == "finite_difference" else 2)
        w = np.array(np.broadcast_to(broadcast, np.shape(personal)), np.float32)
        losses = []
        for step in range(int(steps.max(initial=0))):
            w, loss = yield from self.meta_step(w, step < steps)
            losses.append(loss)
        metrics: dict[str, Number] = {
            "train_loss": mean_over_steps(losses, steps),
            "adaptation_loss": adaptation.loss,
            "update_norm": distances(w, broadcast),
        }
        weight = upload_weight(client.num_train, s.aggregation)
        upload = WeightedUpload(per_row(weight) * w.astype(np.float64), weight)
        return ClientUpdate(PerFedAvgClientState(personal), upload, metrics)

    def meta_step(self, w: np.ndarray, active: np.ndarray) -> Generator[Request, Result, tuple[np.ndarray, Number]]:
        """One Per-FedAvg step of the rows still `active` (the others keep w): the new w and the loss at the adapted
        model temp (the meta-objective's stochastic value)."""
        s = self.settings
        first = yield from batch_gradients(BatchGradients(w[..., None, :], s.batch_size))
        temp = w - np.float32(s.alpha) * first.grads[..., 0, :]  # Algorithm 1, line 6
        second = yield from batch_gradients(BatchGradients(temp[..., None, :], s.batch_size))
        direction = second.grads[..., 0, :]
        if s.hessian == "finite_difference":  # eq. (9): (I - alpha H) g, H g by central differences
            shift = np.float32(s.delta) * direction
            points = np.stack([w + shift, w - shift], axis=-2)
            third = yield from batch_gradients(BatchGradients(points, s.batch_size))
            product = (third.grads[..., 0, :] - third.grads[..., 1, :]) / np.float32(2 * s.delta)
            direction = direction - np.float32(s.alpha) * product
        moved = w - np.float32(s.lr) * direction
        return np.where(np.asarray(active)[..., None], moved, w).astype(np.float32), second.losses[..., 0]

    def server_step(self, server: PerFedAvgServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)
        return PerFedAvgServerState(w), metrics

    def global_model(self, server: PerFedAvgServerState) -> Vector:
        return server.w

    def personalized_model(self, state: PerFedAvgClientState) -> Vector:
        return state.personal

    def adapt(self, client: ClientInfo, global_params: Vector) -> AdaptStep:
        """A held-out client's PM: one gradient step of lr alpha from the global model on its training split."""
        adaptation = yield from gradient(FullGradient(global_params, "train"))
        return (global_params - np.float32(self.settings.alpha) * adaptation.grad).astype(np.float32)
