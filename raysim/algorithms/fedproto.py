"""FedProto: clients share class prototypes, not models (Tan et al., AAAI 2022, arXiv:2105.00243).

Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, "FedProto: Federated Prototype Learning across Heterogeneous Clients"; a
baseline of AugFL's Table II (AugFL, Sec. VI; Table II).

Every client keeps its own model (body f_i, the network up to its head, and head g_i; ParamSpec.head) and never
sends it. A selected client

1. trains its model by local SGD on (eq. 8, the authors' code's form)

       CE(g_i(f_i(x)), y) + lambda * (1/(B d)) sum_b ||f_i(x_b) - C_bar^(y_b)||^2

   towards the global prototypes C_bar of the classes that have one (none in round 0: plain local training), the
   per-sample MSE of the authors' code (yuetan031/FedProto `loss_mse(proto_new, protos)`, a sample of a class
   without a global prototype adding 0);
2. computes its local prototypes, the mean features of each of its classes over its training split (eq. 5), at
   its trained model (the authors' code averages the features of every training batch as it trains instead);
3. uploads them with the class counts |D_i,j|.

The server averages the prototypes per class over the clients that hold the class, weighted by their counts
(eq. 7, `aggregation: samples`; `clients`: the unweighted mean of the authors' code), from this round's uploads.

PM = the client's own model, scored by its head (the paper's evaluation of the local models). `proto` (extra
model, `proto/acc`, ...) = the client's body with inference by the nearest global prototype, the authors' code's
second accuracy (`test_inference_new_het_lt`: the class whose prototype has the least mean squared distance
||z - C_bar^(j)||^2 / d to the features z). As logits -||z - C_bar^(j)||^2 / d, whose softmax equals that of
(2 z.C_bar^(j) - ||C_bar^(j)||^2) / d, it is the client's network with that linear head in place of its own: so it
is scored like any model (accuracy, loss of the softmax over negative distances, F1, AUC). A class without a global
prototype is never predicted (its distance is infinite in the authors' code; here its logit is -1e9). It needs a
head with a bias (ResNet-18-GN's on CIFAR has none: no `proto` there) and is scored from the first aggregation on.
GM: there is no global model; the common initial model is reported as raysim's Local does. Uplink: the prototypes
and counts of the classes a client holds; downlink: the global prototypes that exist (classes x feature dimension).

The local loss is this module's term (`PrototypePull`): its features come through FlatModel.features, one client at
a time (not stacked, `stacks = False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate, Upload
from raysim.algorithms.requests import ClassMeans, Vector, class_means, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel


@dataclass(frozen=True, eq=False)
class PrototypePull(Term):
    """Eq. 8's local loss in place of f_i: CE(logits, y) + weight * (1/(B d)) sum_b ||z_b - targets[y_b]||^2 over a
    batch of B samples with features z = f(x) (the head's input), a sample whose class has no target (`has_target`)
    adding 0 (an MSE against itself), divided by B d as torch's mse_loss divides it."""

    targets: np.ndarray
    """[classes, d]: the global prototypes."""
    has_target: np.ndarray
    """[classes] bool."""
    weight: float
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch import nn

        if model.task != "classification":
            raise ValueError(f"FedProto's loss needs a classifier; model {model.name!r} is trained for {model.task}")
        with model.dropout(seed):
            features, logits = model.features(point, x)
        total = nn.functional.cross_entropy(logits, y)
        if self.weight:
            # Copies: the arrays may be read-only views of Ray's object store, which torch must not alias.
            targets = torch.tensor(np.asarray(self.targets, np.float32))[y]
            kept = torch.tensor(np.asarray(self.has_target, bool))[y]
            targets = torch.where(kept[:, None], targets, features.detach())
            total = total + self.weight * nn.functional.mse_loss(features, targets)
        return total


class FedProtoSettings(SGDSettings):
    name: Literal["fedproto"] = "fedproto"
    lam: float = Field(
        1.0,
        ge=0,
        alias="lambda",
        description="lambda: weight of the pull of features towards the global prototypes "
        "(eq. 8; 1 in the authors' code, `ld`)",
    )
    aggregation: Literal["samples", "clients"] = Field(
        "samples",
        description="global prototype of a class: the clients' prototypes weighted by their counts of the class "
        "(eq. 7), or their unweighted mean (the authors' code)",
    )


@dataclass
class FedProtoClientState:
    theta: Vector
    """The client's own model (body and head), never sent."""


@dataclass
class FedProtoBroadcast:
    prototypes: np.ndarray
    """[classes, d] float32: the global prototypes C_bar (zero for a class without one)."""
    present: np.ndarray
    """[classes] bool: the classes that have a global prototype."""


@dataclass
class FedProtoServerState:
    w: Vector
    """The common initial model (FedProto has no global model)."""
    prototypes: FedProtoBroadcast


@dataclass
class PrototypeUpload(Upload):
    """A client's local prototypes, each times its weight (its class count, or 1 for a class it holds), and the
    weights: summed over the clients, their quotient is the global prototype of each class (eq. 7)."""

    weighted: np.ndarray
    """[classes, d] float64."""
    weight: np.ndarray
    """[classes] float64 (0 for a class the client does not hold)."""


@ALGORITHMS.register()
class FedProto(
    Algorithm[FedProtoSettings, FedProtoClientState, FedProtoServerState, FedProtoBroadcast, PrototypeUpload]
):
    name = "fedproto"
    Settings = FedProtoSettings
    Upload = PrototypeUpload

    def __init__(self, settings: FedProtoSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.classes, self.feature_dim = params.head_outputs, params.feature_dim
        self.params = params

    def init_server(self, init_params: Vector, num_clients: int) -> FedProtoServerState:
        empty = FedProtoBroadcast(
            np.zeros((self.classes, self.feature_dim), np.float32), np.zeros(self.classes, dtype=bool)
        )
        return FedProtoServerState(init_params.copy(), empty)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedProtoClientState:
        return FedProtoClientState(init_params.copy())

    def broadcast(self, server: FedProtoServerState) -> FedProtoBroadcast:
        return server.prototypes

    def client_step(self, client: ClientInfo, state: FedProtoClientState, broadcast: FedProtoBroadcast) -> ClientStep:
        s = self.settings
        regularized = s.lam > 0 and bool(broadcast.present.any())
        pull = PrototypePull(broadcast.prototypes, broadcast.present, s.lam)
        result = yield from train(s.local_sgd(state.theta, terms=(pull,) if regularized else ()))  # eq. 8
        theta = np.asarray(result.params, np.float32)
        means = np.zeros((self.classes, self.feature_dim))
        counts = np.zeros(self.classes)
        if client.num_train:  # eq. 5: the local prototypes C_i^(j)
            local = yield from class_means(ClassMeans(theta))
            counts = local.counts
            means = means if local.means is None else local.means.astype(np.float64)
        held = counts > 0
        weight = counts if s.aggregation == "samples" else held.astype(np.float64)
        upload = PrototypeUpload(weight[:, None] * means, weight)
        metrics = {"train_loss": result.mean_loss, "classes_held": float(held.sum())}
        return ClientUpdate(FedProtoClientState(theta), upload, metrics)

    def server_step(self, server: FedProtoServerState, total: PrototypeUpload, num_selected: int):
        """eq. 7: C_bar^(j) = sum_i w_ij C_i^(j) / sum_i w_ij over the selected clients holding class j."""
        present = total.weight > 0
        prototypes = np.zeros_like(server.prototypes.prototypes)
        prototypes[present] = (total.weighted[present] / total.weight[present, None]).astype(np.float32)
        before = server.prototypes
        change = np.linalg.norm(prototypes[present & before.present] - before.prototypes[present & before.present])
        metrics = {"global_change": float(change), "prototype_classes": float(present.sum())}
        return FedProtoServerState(server.w, FedProtoBroadcast(prototypes, present)), metrics

    def global_model(self, server: FedProtoServerState) -> Vector:
        return server.w

    def personalized_model(self, state: FedProtoClientState) -> Vector:
        return state.theta

    def evaluation_context(self, server: FedProtoServerState) -> FedProtoBroadcast:
        """The global prototypes, for nearest-prototype inference (`extra_models`)."""
        return server.prototypes

    def extra_models(
        self, state: FedProtoClientState, global_params: Vector, context: FedProtoBroadcast | None = None
    ) -> dict[str, Vector]:
        """`proto`: the client's body with the nearest-global-prototype classifier as its head (module docstring)."""
        if context is None or not context.present.any() or len(self.params.head) < 2:
            return {}
        return {"proto": prototype_classifier(self.params, state.theta, context)}

    def uplink_bytes(self, upload: PrototypeUpload) -> int:
        """The prototype and the count of each class the client holds, as float32."""
        return 4 * int((upload.weight > 0).sum()) * (self.feature_dim + 1)

    def downlink_bytes(self, broadcast: FedProtoBroadcast) -> int:
        """The global prototypes that exist, as float32 (classes x feature dimension)."""
        return 4 * int(broadcast.present.sum()) * self.feature_dim


NO_PROTOTYPE_LOGIT = -1e9
"""The logit of a class without a global prototype: never predicted (the authors' code's infinite distance)."""


def prototype_classifier(params: ParamSpec, theta: Vector, prototypes: FedProtoBroadcast) -> Vector:
    """theta with its head (weight W, bias b) replaced by W_j = 2 C_bar^(j) / d, b_j = -||C_bar^(j)||^2 / d: logits
    that differ from -||z - C_bar^(j)||^2 / d by -||z||^2 / d, the same for every class, so the same softmax and the
    same nearest prototype."""
    weight_name, bias_name = params.head[:2]
    centers = prototypes.prototypes.astype(np.float64)
    d = params.feature_dim
    weight = np.where(prototypes.present[:, None], 2.0 * centers / d, 0.0)
    bias = np.where(prototypes.present, -(centers**2).sum(axis=1) / d, NO_PROTOTYPE_LOGIT)
    model = np.array(theta, dtype=np.float32, copy=True)
    model[params.slice(weight_name)] = weight.ravel()
    model[params.slice(bias_name)] = bias
    return model
