"""TERM-style tilted aggregation: the clients' models averaged with weights exponential in their losses (Li,
Beirami, Sanjabi and Smith, "Tilted Empirical Risk Minimization", ICLR 2021, arXiv:2007.01162).

The tilted objective across clients is R(t; w) = (1/t) log((1/N) sum_k exp(t F_k(w))): t > 0 moves it from the
mean loss towards the worst client's (fairness), t < 0 towards the best one's (robustness to outlier clients), and
t -> 0 is the mean. Its gradient is sum_k p_k(t) grad F_k(w), p_k(t) proportional to exp(t F_k(w)) (eq. 2 of the
paper). Federated, as FedAvg's step approximates a gradient step on the mean: a selected client k runs `epochs`
epochs of local SGD from w to w_k, computes its training loss F_k(w) at the received model, and uploads
e_k w_k and e_k with e_k = exp(t (F_k(w) - c)); the server takes w <- sum_k e_k w_k / sum_k e_k, the tilted mean
(the common factor exp(-t c) cancels). c is the mean of the previous round's F_k (0 before the first), which the
server broadcasts with w: it keeps the weights near 1, within the range the runtime sums exactly. The exponent
t (F_k - c) is clipped to [-15, 15] (a weight ratio of e^30 between two clients: the larger one is the mean). t = 0
is FedAvg with equal weights (tests check it). Default t = 0.1: with losses of a few nats, t = 1 lets the worst
client's local model dominate every round and the mean oscillates (measured in docs/algorithms.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, weighted_average
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import FullGradient, Number, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.jit import distances


class TermSettings(SGDSettings):
    name: Literal["term"] = "term"
    tilt: float = Field(
        0.1, description="t: > 0 weighs the clients with higher loss more (fairness), < 0 less, 0 is FedAvg"
    )


TILT_RANGE = 15.0
"""The largest |t (F_k - c)|: exp(15) ~ 3.3e6, so that e_k w_k stays within the exact sums' range."""


@dataclass
class TermBroadcast:
    w: Vector
    reference: float
    """c: the mean of the previous round's losses at the received model."""


@dataclass
class TermUpload(WeightedUpload):
    """e_k w_k and e_k (the averaging upload), and F_k(w) with a count, for the next round's c."""

    loss: Number
    count: Number


@dataclass
class TermClientState:
    """A TERM client keeps nothing between rounds."""


@dataclass
class TermServerState:
    w: Vector
    reference: float = 0.0


@ALGORITHMS.register()
class TiltedAveraging(Algorithm[TermSettings, TermClientState, TermServerState, TermBroadcast, TermUpload]):
    """FedAvg's rounds with the server's weights exp(t F_k(w))."""

    name = "term"
    Settings = TermSettings
    Upload = TermUpload

    def init_server(self, init_params: Vector, num_clients: int) -> TermServerState:
        return TermServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> TermClientState:
        return TermClientState()

    def broadcast(self, server: TermServerState) -> TermBroadcast:
        return TermBroadcast(server.w, server.reference)

    def client_step(self, client: ClientInfo, state: TermClientState, received: TermBroadcast) -> ClientStep:
        s, w = self.settings, received.w
        result = yield from train(s.local_sgd(w))  # first, as FedAvg's: the same batches (t = 0 is FedAvg)
        at_w = yield from gradient(FullGradient(w, "train"))
        exponent = min(max(s.tilt * (float(at_w.loss) - received.reference), -TILT_RANGE), TILT_RANGE)
        weight = math.exp(exponent)
        params = np.asarray(result.params, np.float64)
        metrics = {
            "train_loss": result.mean_loss,
            "loss_at_global": float(at_w.loss),
            "tilt_weight": weight,
            "update_norm": distances(np.asarray(result.params, np.float32), w),
        }
        return ClientUpdate(state, TermUpload(weight * params, weight, float(at_w.loss), 1.0), metrics)

    def server_step(self, server: TermServerState, total: TermUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # sum_k e_k w_k / sum_k e_k
        return TermServerState(w, float(total.loss / total.count)), metrics

    def global_model(self, server: TermServerState) -> Vector:
        return server.w
