"""FedALA: FedAvg whose clients start each round from an adaptive local aggregation (ALA) of the received global
model and their own previous model (Zhang, Hua, Wang, Song, Xue, Ma, Guan: "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023, arXiv:2212.01197), a baseline of FedAPM's Table 4 (FedAPM, App. B.5.3,
Table 4).

Client i keeps its local model theta_i (after its last local training) and element-wise weights W_i in [0, 1] over
the top `layer_idx` parameter tensors (the higher layers). Selected with the global model w, it initializes

    theta = theta_i + (w - theta_i) (.) W_i   on the higher layers,   theta = w   on the lower ones   (ALA, eq. 4)

learning W_i first by gradient steps on the local loss at that theta, clipped to [0, 1] (eqs. 5-6):

    W_i <- clip(W_i - eta grad_theta L(theta) (.) (w - theta_i), 0, 1)

then runs ordinary local SGD from theta (`epochs`, `lr`, ...) and uploads the result, which the server averages
weighted by training-set size (FedAvg, FLAME, Sec. IV-E). As the authors' code (TsingZ0/FedALA, system/utils/ALA.py):
W_i starts at 1; the weights learn on a random `rand_percent`% of the training split drawn once per round, in
mini-batches of `batch_size` taken in one order (the last incomplete one dropped), one W step per batch; the
loss of an epoch's last batch is recorded; at the first ALA of a client (its second participation: at its first
there is no local model yet and it starts from w, the code's "deactivate ALA at the 1st communication iteration")
W learns until the standard deviation of the last `num_pre_loss` recorded losses is below `threshold` (after more
than `num_pre_loss` epochs; `max_start_epochs` caps it, the code has no cap), and one epoch at every later one.
`layer_idx` counts tensors as the code's `list(model.parameters())[-layer_idx:]` does: 2 is the last layer's
weight and bias, and 0 takes every tensor (Python's [-0:]), so no `layer_idx` gives FedAvg; `eta: 0` (W stays 1,
theta = w, and no weight epochs run) does.

Two departures from their code, both for raysim's protocol: ALA runs on the selected clients only (their server
re-initializes every client every round; with full participation, as their experiments, the same), and the
subset is a uniformly random one rather than a contiguous slice at a random offset of the stored order. The
personalized model scored is the client's own model after its last local training (FedAPM's protocol, the
authors' code). Per round a client receives and sends the whole model, as FedAvg.

It does not stack (no ClientChunk step): the start phase's number of weight epochs is each client's own (until its
losses settle), and each weight step depends on the last.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import AveragingServerState, WeightedUpload, weighted_average
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import FullGradient, Request, Result, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.jit import distances
from raysim.models.parts import TensorCount
from raysim.models.spec import ParamSpec


class FedAlaSettings(SGDSettings):
    name: Literal["fedala"] = "fedala"
    eta: float = Field(1.0, ge=0, description="eta: learning rate of the aggregation weights W (authors' 1.0)")
    rand_percent: float = Field(
        80.0, gt=0, le=100, description="s: the share (%) of the training split the weights learn on each round"
    )
    layer_idx: Annotated[int, TensorCount()] = Field(
        2,
        ge=0,
        description="p: the number of top parameter tensors ALA mixes (the authors' 2: the last layer's weight and "
        "bias); the others take the global model; 0 = every tensor, as the code's [-0:]",
    )
    threshold: float = Field(
        0.1, gt=0, description="the start phase ends when the std of the last num_pre_loss losses is below this"
    )
    num_pre_loss: int = Field(10, ge=1, description="how many recorded losses the start phase's std looks at")
    max_start_epochs: int = Field(
        100, ge=1, description="cap on the start phase's weight epochs (the authors' loop runs until convergence)"
    )


@dataclass
class FedAlaClientState:
    local: Vector
    """theta_i: the client's model after its last local training (the initial model before it ever trained)."""
    weights: Vector
    """W_i: the aggregation weights of the higher layers' coordinates, in [0, 1] (float32)."""
    participations: int
    """0: no local model yet (no ALA); 1: the next ALA is the start phase; more: one weight epoch per round."""


def top_start(params: ParamSpec, layer_idx: int) -> int:
    """Where the top `layer_idx` parameter tensors begin in the flat vector (0: all of them, as [-0:] takes)."""
    if layer_idx == 0 or layer_idx >= len(params.offsets):
        return 0
    return params.offsets[-layer_idx]


@ALGORITHMS.register()
class FedAla(Algorithm[FedAlaSettings, FedAlaClientState, AveragingServerState, Vector, WeightedUpload]):
    name = "fedala"
    Settings = FedAlaSettings
    Upload = WeightedUpload
    scales_loss = True

    def __init__(self, settings: FedAlaSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.top = slice(top_start(params, settings.layer_idx), params.size)
        """The higher layers' coordinates, those ALA mixes."""

    def init_server(self, init_params: Vector, num_clients: int) -> AveragingServerState:
        return AveragingServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedAlaClientState:
        return FedAlaClientState(init_params.copy(), np.ones_like(init_params[self.top]), 0)

    def broadcast(self, server: AveragingServerState) -> Vector:
        return server.w

    def mix(self, local: Vector, w: Vector, weights: Vector) -> Vector:
        """theta = theta_i + (w - theta_i) (.) W on the higher layers, w on the lower ones (eq. 4)."""
        theta = w.astype(np.float32, copy=True)
        theta[self.top] = local[self.top] + (w[self.top] - local[self.top]) * weights
        return theta

    def weight_gradient(self, grad: Vector, local: Vector, w: Vector) -> Vector:
        """grad_W L(theta(W)) = grad_theta L(theta) (.) (w - theta_i) on the higher layers (chain rule of eq. 4)."""
        return grad[self.top] * (w[self.top] - local[self.top])

    def adaptive_local_aggregation(
        self, state: FedAlaClientState, w: Vector
    ) -> Generator[Request, Result, tuple[Vector, Vector, int, float]]:
        """The round's starting model and the learned W (eqs. 4-6), and the number of weight epochs and the loss on
        the drawn subset at the start."""
        s = self.settings
        weights = state.weights.copy()
        theta = self.mix(state.local, w, weights)
        if s.eta == 0:  # W cannot move: no weight learning to run (and no draws taken from the client's stream)
            return theta, weights, 0, float("nan")
        drawn = yield from gradient(FullGradient(theta, fraction=s.rand_percent / 100))
        subset = drawn.indices if drawn.indices is not None else np.zeros(0, np.int64)
        size = s.batch_size
        batches = [subset[i : i + size] for i in range(0, len(subset) - size + 1, size)]
        if not batches and len(subset):  # fewer samples than one batch: the whole subset is the batch
            batches = [subset]
        losses: list[float] = []
        while batches:
            for batch in batches:
                result = yield from gradient(FullGradient(theta, indices=batch))
                step = s.eta * self.weight_gradient(result.grad, state.local, w)
                weights = np.clip(weights - step, 0.0, 1.0).astype(np.float32)  # eqs. 5-6
                theta = self.mix(state.local, w, weights)
            losses.append(result.loss)  # the epoch's last batch's, as the authors record
            start_phase = state.participations == 1
            if not start_phase or len(losses) >= s.max_start_epochs:
                break
            if len(losses) > s.num_pre_loss and np.std(losses[-s.num_pre_loss :]) < s.threshold:
                break
        return theta, weights, len(losses), drawn.loss

    def client_step(self, client: ClientInfo, state: FedAlaClientState, broadcast: Vector) -> ClientStep:
        if state.participations == 0:  # no local model yet: start from w (the code skips ALA)
            start, weights, epochs, ala_loss = broadcast, state.weights, 0, float("nan")
        else:
            start, weights, epochs, ala_loss = yield from self.adaptive_local_aggregation(state, broadcast)
        result = yield from train(self.settings.scaled(self.settings.local_sgd(start), client.num_clients))
        params = np.asarray(result.params, np.float32)
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": distances(params, start),
            "ala_epochs": float(epochs),
            "ala_loss": ala_loss,
            "ala_weight_mean": float(np.mean(weights)) if weights.size else float("nan"),
            "start_gap": float(np.linalg.norm(start - broadcast)),
        }
        samples = float(client.num_train)
        new = FedAlaClientState(params, weights, state.participations + 1)
        return ClientUpdate(new, WeightedUpload(samples * params.astype(np.float64), samples), metrics)

    def server_step(self, server: AveragingServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # w = sum_i n_i theta_i / sum_i n_i
        return AveragingServerState(w), metrics

    def global_model(self, server: AveragingServerState) -> Vector:
        return server.w

    def personalized_model(self, state: FedAlaClientState) -> Vector:
        return state.local
