"""FedAS: federated parameter-alignment and client-synchronization (Yang, Huang and Ye, "FedAS: Bridging
Inconsistency in Personalized Federated Learning", CVPR 2024; the authors' code xiyuanyang45/FedAS, in PFLlib as
FedAS and in FL-bench).

A split model: the body (everything before the head, ParamSpec.head) is shared, the head personal. Every client
keeps its own model theta_i = (body_i, head_i), the PM. A selected client

1. aligns the received global body to its own (federated parameter-alignment): at its own model it takes the mean
   features of each of its classes over its training split, the prototypes P_c = mean_{y = c} f(x; body_i), then
   trains the received body alone (its head frozen) for `alignment_epochs` epochs of plain SGD (`alignment_lr`,
   batches of `alignment_batch_size`) on

       sum_{c in batch} (1/(n_c d)) sum_{b: y_b = c} ||f(x_b; body) - P_c||^2         (`alignment_target: samples`)

   the per-class mean squared error of the authors' code (torch's MSELoss of each sample's features against its
   class prototype), and adopts the aligned body with its own head;
2. trains its whole model from there by `epochs` epochs of local SGD (as FedPer);
3. estimates the Fisher information of its trained model on its training split, the sum over max(1, n_i // B)
   batches of B = `batch_size` samples of the squared gradient of the batch's mean loss (the authors' code: the
   batches of one pass with drop_last, in eval mode), F_i = sum_b g_b * g_b, each batch a FullGradient over a
   uniform draw of B samples (no augmentation, no dropout);
4. uploads its body weighted by its Fisher weight, and the weight (client synchronization).

The server averages the bodies with those weights, normalized over the round's clients:

    body = sum_i a_i body_i / sum_i a_i,   a_i = tr(F_i) (`aggregation: fisher_trace`, the authors' code's
                                                        client weights, PFLlib's and FL-bench's too)

so an under-trained straggler counts by its Fisher trace, not its data size. `fisher_diagonal` weights each
coordinate by the clients' diagonal Fisher information instead, a_i = F_i + `fisher_floor` (body coordinates;
running statistics weighted equally), Fisher merging's per-coordinate average (Matena and Raffel 2022), which
neither the authors' code nor PFLlib or FL-bench uses; `samples` (n_i) is the authors' `wo_global` ablation, and
`alignment: false` their `wo_local`.
Both numerator and denominator are sums, so the runtime sums them exactly and the server needs nothing else; a
coordinate whose total weight is 0 keeps the previous global value.

`alignment_target: class_means` is FL-bench's loss, the squared distance of each class's mean feature in the batch
to its prototype, sum_c ||mean_{b: y_b = c} f(x_b) - P_c||^2 / d (it is 0 in expectation at the client's own body,
where the authors' loss still pulls every sample to its class mean). FL-bench's FedAS also adopts the global head
and weights the whole model; here the head stays personal, as in the authors' code. A client's first round aligns
to its initial model (the authors' code). The Fisher trace is over the whole model, head included (the authors').

PM: the client's own model after its last training; before it first trains, the GM. GM: the global body with the
initial head. Communication: the body down; the weighted body and the weight up (the weight a body-sized vector
with `fisher_diagonal`). With equal Fisher weights and no alignment FedAS is FedPer with equal weights (tests).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload
from raysim.algorithms.families.shared_part import SharedPartServerState
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    server_metrics,
)
from raysim.algorithms.requests import (
    ClassMeans,
    FullGradient,
    LocalSGD,
    Number,
    Request,
    Result,
    Vector,
    class_means,
    gradient,
    train,
)
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.errors import ConfigError
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel


@dataclass(frozen=True, eq=False)
class PrototypeAlignment(Term):
    """The alignment loss in place of f_i on a batch with features z = f(x) (the head's input): each sample pulled
    to its class's prototype, sum_c (1/(n_c d)) sum_{y_b = c} ||z_b - P_c||^2 (the authors' code), or with
    `class_means` each class's mean feature in the batch, sum_c ||mean_c z - P_c||^2 / d (FL-bench's); a sample of
    a class without a prototype adds 0."""

    targets: np.ndarray
    """[classes, d]: the prototypes P_c of the client's own model."""
    has_target: np.ndarray
    """[classes] bool."""
    class_means: bool
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch

        if model.task != "classification":
            raise ValueError(f"FedAS's alignment needs a classifier; model {model.name!r} is trained for {model.task}")
        with model.dropout(seed):
            features, _ = model.features(point, x)
        targets = self.tensor("targets")
        labels = y.long()
        kept = torch.from_numpy(np.array(self.has_target, bool))[labels].to(features.dtype)
        members = torch.nn.functional.one_hot(labels, len(targets)).to(features.dtype) * kept[:, None]
        counts = members.sum(0)  # n_c: the batch's samples of each class that has a prototype
        d = features.shape[1]
        if not self.class_means:
            squared = ((features - targets[labels]) ** 2).sum(1)
            return (squared * kept / counts[labels].clamp(min=1)).sum() / d
        present = counts > 0
        means = (members.T @ features)[present] / counts[present, None]
        return ((means - targets[present]) ** 2).sum() / d + 0 * features.sum()


def fisher_information(theta: Vector, num_train: int, batch_size: int) -> Generator[Request, Result, np.ndarray]:
    """The diagonal empirical Fisher information at `theta` on the client's training split: the sum over
    max(1, n_i // B) batches of B samples, each a uniform draw (a FullGradient, no augmentation, no dropout), of the
    squared gradient of the batch's mean loss (the authors' code sums over one pass of drop_last batches); one batch
    of the whole split when n_i <= B. float64, the whole model's coordinates; zero for a client without data."""
    fisher = np.zeros(np.shape(theta), np.float64)
    if not num_train:
        return fisher
    fraction = min(1.0, (batch_size + 0.5) / num_train)  # floor(fraction n_i) = B samples, or the whole split
    for _ in range(max(1, num_train // batch_size)):
        result = yield from gradient(FullGradient(theta, fraction=fraction))
        fisher += np.asarray(result.grad, np.float64) ** 2
    return fisher


class FedASSettings(SGDSettings):
    name: Literal["fedas"] = "fedas"
    alignment: bool = Field(
        True,
        description="federated parameter-alignment: align the received body to the client's own features before "
        "training (false: the authors' `wo_local` ablation)",
    )
    alignment_lr: float = Field(0.01, gt=0, description="the alignment's SGD rate (0.01, the authors' code)")
    alignment_epochs: int = Field(1, ge=1, description="the alignment's passes over the training split (1)")
    alignment_batch_size: int = Field(16, ge=1, description="the alignment's batch (16, the authors' code)")
    alignment_target: Literal["samples", "class_means"] = Field(
        "samples",
        description="the alignment loss: each sample's features to its class prototype (the authors' code), or each "
        "class's mean feature in the batch (FL-bench)",
    )
    aggregation: Literal["fisher_trace", "fisher_diagonal", "samples"] = Field(
        "fisher_trace",
        description="the bodies' weights: each client's Fisher trace (the authors' code, PFLlib, FL-bench), its "
        "diagonal Fisher per coordinate, or n_i (the authors' `wo_global` ablation)",
    )
    fisher_floor: float = Field(
        1e-6,
        ge=0,
        description="with fisher_diagonal: added to every client's Fisher coordinate, so that a coordinate no client "
        "has information on is averaged equally (and above the runtime's fixed-point resolution, 2^-32)",
    )


@dataclass
class FedASClientState:
    theta: Vector
    """The client's own model (its body from its last round, its head), the PM."""
    trained: bool
    """Whether it has trained yet (before, it deploys the GM)."""


@ALGORITHMS.register()
class FedAS(Algorithm[FedASSettings, FedASClientState, SharedPartServerState, Vector, WeightedUpload]):
    """Bodies aligned to the client's own features before training, averaged by Fisher weights; heads personal."""

    name = "fedas"
    Settings = FedASSettings
    Upload = WeightedUpload
    scales_loss = True

    def __init__(self, settings: FedASSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.head = params.head_mask()
        self.body = ~self.head
        if not self.body.any():
            raise ConfigError(f"fedas needs a model with a body before its head; model {params.model!r} has none")
        self.statistics = params.statistics_mask()[self.body]

    def init_server(self, init_params: Vector, num_clients: int) -> SharedPartServerState:
        return SharedPartServerState(init_params[self.body].copy(), init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedASClientState:
        return FedASClientState(init_params.copy(), False)

    def broadcast(self, server: SharedPartServerState) -> Vector:
        return server.shared

    def client_step(self, client: ClientInfo, state: FedASClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        start = state.theta.copy()
        start[self.body] = broadcast
        metrics: dict[str, Number] = {}
        if s.alignment and client.num_train:
            start, metrics["alignment_loss"] = yield from self.align(state.theta, start)
            metrics["alignment_change"] = float(np.linalg.norm(start[self.body] - broadcast.astype(np.float64)))
        result = yield from train(s.scaled(s.local_sgd(start), client.num_clients))
        theta = np.asarray(result.params, np.float32)
        body = theta[self.body]
        if s.aggregation == "samples":
            weight: Number = np.float32(client.num_train)
            weighted = weight * body
        else:
            fisher = yield from fisher_information(theta, client.num_train, s.batch_size)
            metrics["fisher_trace"] = float(fisher.sum())
            weight = self.fisher_weight(fisher)
            weighted = weight * body.astype(np.float64)
        metrics["train_loss"] = result.mean_loss
        return ClientUpdate(FedASClientState(theta, True), WeightedUpload(weighted, weight), metrics)

    def fisher_weight(self, fisher: np.ndarray) -> Number:
        """a_i: the trace tr(F_i), or with fisher_diagonal F_i + fisher_floor on the body (1 on running statistics,
        which have no gradient: an equal average)."""
        if self.settings.aggregation == "fisher_trace":
            return float(fisher.sum())
        diagonal = fisher[self.body] + self.settings.fisher_floor
        diagonal[self.statistics] = 1.0
        return diagonal

    def align(self, own: Vector, start: Vector) -> Generator[Request, Result, tuple[Vector, float]]:
        """Federated parameter-alignment: `alignment_epochs` of SGD over the body of `start` (the received body and
        the client's head) on the alignment loss towards the class prototypes of the client's own model `own`."""
        s = self.settings
        local = yield from class_means(ClassMeans(own))
        if local.means is None:
            raise ValueError("FedAS: a ClassMeans request at a point was answered without means")
        term = PrototypeAlignment(local.means, local.counts > 0, s.alignment_target == "class_means")
        request = LocalSGD(
            start, s.alignment_epochs, s.alignment_lr, s.alignment_batch_size, terms=(term,), mask=self.body
        )
        result = yield from train(request)
        return np.asarray(result.params, np.float32), float(result.mean_loss)

    def server_step(
        self, server: SharedPartServerState, total: WeightedUpload, num_selected: int
    ) -> tuple[SharedPartServerState, dict[str, float]]:
        """body = sum_i a_i body_i / sum_i a_i, per coordinate; the previous body where the total weight is 0."""
        weight = np.asarray(total.weight, np.float64)
        weighted = np.asarray(total.weighted, np.float64)
        known = np.broadcast_to(weight > 0, weighted.shape)
        body = np.where(known, weighted / np.where(weight > 0, weight, 1.0), server.shared).astype(np.float32)
        metrics = server_metrics(body, server.shared)
        metrics["uninformed"] = float((~known).sum())
        return SharedPartServerState(body, server.template), metrics

    def global_model(self, server: SharedPartServerState) -> Vector:
        model = server.template.copy()
        model[self.body] = server.shared
        return model

    def personalized_model(self, state: FedASClientState) -> Vector | None:
        """The client's own model once it has trained; the GM before."""
        return state.theta if state.trained else None

    def message(self, update: ClientUpdate) -> Vector:
        """The body the client sent (its weight may be a vector, so the message is read from its new state)."""
        return np.asarray(update.state.theta[self.body], np.float64)

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.body]
