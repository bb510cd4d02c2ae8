"""FedPCL: frozen pretrained encoders, a projection learned by prototype-wise contrastive learning, and only class
prototypes exchanged (Tan, Long, Ma, Liu, Zhou, Jiang, "Federated Learning from Pre-Trained Models: A Contrastive
Learning Approach", NeurIPS 2022, arXiv:2209.10083); a PM-aided baseline of AugFL's Table II (AugFL, Sec. VI; Table II).
The paper's text was not reachable from here (its abstract and the authors' code yuetan031/FedPCL were), so the
update below is named by its parts (local and global prototypes, the global- and local-prototype contrastive terms)
and by the authors' functions, not by equation numbers.

Every client holds a fixed pretrained encoder f (the paper's backbones; here the body of the clients' model, up to
its head, from the weights file `teacher_weights` that `raysim pretrain` writes, or pretrained on the first pool the
`meta` partition keeps back, as FedLP's PM; raysim.algorithms.augfl.teacher) and learns a projection g_i, here the
model's head: z = g_i(f(x)) / ||g_i(f(x))|| (the paper's normalized representation; its code's projector is
Linear -> ReLU -> normalize to 256-d, here it is the linear head itself, of the classes' dimension, so that
nearest-prototype inference is the network with another linear head, below). A selected client

1. trains only g_i (the encoder frozen: LocalSGD.mask) for `epochs` passes on the prototype-wise contrastive loss
   (the paper's global-prototype term plus the mean over the clients of its local-prototype terms)

       L = -log [exp(s(z, C_bar^(y)) / tau) / sum_j exp(s(z, C_bar^(j)) / tau)]
           + (1/m) sum_k -log [exp(s(z, C_k^(y)) / tau) / sum_j exp(s(z, C_k^(j)) / tau)]

   with s(z, C) = <z, C>, tau = `temperature` (0.07, the authors' ConLoss), the sums over the classes that have a
   global prototype, a class that client k does not hold taking the global prototype in its set (the authors'
   `update_weights_lg`), m the clients whose local prototypes the server holds (raysim.algorithms.fedpcl.
   PrototypeContrast); before any prototype exists (round 0) the loss is empty and g_i stays as it is (the authors'
   `loss2 = 0` until every client has uploaded);
2. computes its local prototypes C_i^(j), the mean embedding z of each of its classes over its training split
   (the paper's local prototype; the authors' `agg_func` of the eval-mode embeddings);
3. uploads them with its class counts.

The server forms the global prototypes C_bar^(j), the count-weighted mean of the clients'
local prototypes of class j (`aggregation: clients`: the unweighted mean of the authors' `proto_aggregation`),
keeps every client's latest local prototypes, and broadcasts both: no model parameter travels. The authors' code
takes two augmented views per sample and a SupCon-style loss anchored at the prototypes (`ConLoss`); this module
takes the paper's form on one view (the dataset's augmentation when configured).

Inference (the authors' `test_inference_twoway`): the nearest of the client's own local prototypes. With
s(z, C) = <z, C> and z = h / ||h|| the class argmax_j <h, C_j> does not depend on ||h||, so the classifier is the
client's network with its head (W, b) replaced by (P W / tau, P b / tau), P the prototypes by class: PM is that
network with the client's local prototypes (a class it does not hold has the logit -1e9, never predicted; on a head
without a bias, 0), `proto` (extra model) with the global prototypes. Accuracy is exactly nearest-prototype
accuracy; loss and AUC are those of the softmax of <h, C_j> / tau (||h|| times the training loss's logits). GM:
there is no global model; the common initial model (the pretrained encoder with the initial head) is reported.

Communication: uplink the prototypes and counts of the classes a client holds; downlink the global
prototypes and every client's local prototypes. The encoder is not FL traffic (the paper's clients hold the
off-the-shelf backbones): raysim hands it to a client with the broadcast it first trains on, uncounted.

Persistent client state: the model (encoder and projection) and its local prototypes; the server's: the initial
model and every client's latest prototypes; both checkpointed like any state. The contrastive loss is this module's
term (`PrototypeContrast`), one client at a time (not stacked, `stacks = False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.teacher import PretrainingSettings, pretrained_parameters
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerContext,
    Upload,
)
from raysim.algorithms.requests import ClassMeans, ServerDataStep, Vector, class_means, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.errors import ConfigError
from raysim.examples import ExampleContext, Fragment
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel

NO_PROTOTYPE_LOGIT = -1e9
"""The logit of a class without a prototype: never predicted."""


@dataclass(frozen=True, eq=False)
class PrototypeContrast(Term):
    """The prototype-wise contrastive loss in place of f_i, on a classifier whose head is a projection: the embedding
    of x is z = h / ||h|| with h the head's output, and for each set s of class prototypes P_s [classes, d]

        sum_s weights[s] * mean_b -log softmax_j(<z_b, P_s[j]> / temperature)[y_b]

    the softmax over the classes that have a prototype (`present`), the mean over the batch's samples whose class has
    one (a sample of another class adds nothing). Set 0 is the global prototypes, the others the clients' local ones;
    `weights` the terms' weights (1, then 1/m each)."""

    prototypes: np.ndarray
    """[sets, classes, d]."""
    present: np.ndarray
    """[classes] bool."""
    weights: np.ndarray
    """[sets]."""
    temperature: float
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch import nn

        with model.dropout(seed):
            z = nn.functional.normalize(model.forward(point, x), dim=1)
        present = torch.tensor(np.asarray(self.present, bool))
        kept = present[y]
        total = point.new_zeros(())
        if kept.any():
            prototypes = torch.tensor(np.asarray(self.prototypes, np.float32))
            logits = torch.einsum("bd,scd->sbc", z[kept], prototypes) / self.temperature
            logits = logits.masked_fill(~present, float("-inf"))
            for index, weight in enumerate(np.asarray(self.weights, np.float64)):
                total = total + float(weight) * nn.functional.cross_entropy(logits[index], y[kept])
        return total


class FedPclSettings(SGDSettings, PretrainingSettings):
    name: Literal["fedpcl"] = "fedpcl"
    temperature: float = Field(0.07, gt=0, description="tau of the contrastive loss (0.07, the authors' ConLoss)")
    aggregation: Literal["samples", "clients"] = Field(
        "samples",
        description="global prototype of a class: the clients' local prototypes weighted by their counts of the "
        "class, or their unweighted mean (the authors' proto_aggregation)",
    )


@dataclass
class FedPclClientState:
    theta: Vector
    """The client's network: the frozen encoder (from its first broadcast on) and its projection head."""
    prototypes: np.ndarray
    """[classes, d] float32: its local prototypes C_i^(j) (zero for a class it does not hold)."""
    held: np.ndarray
    """[classes] bool: the classes it holds a prototype of (none before its first step)."""


@dataclass
class FedPclBroadcast:
    initial: Vector
    """The common initial model: the pretrained encoder with the initial head (a client takes it once; not counted
    as traffic, see the module docstring)."""
    prototypes: np.ndarray
    """[classes, d] float32: the global prototypes C_bar (zero for a class without one)."""
    present: np.ndarray
    """[classes] bool."""
    local: np.ndarray
    """[m, classes, d] float32: every training client's latest local prototypes."""
    held: np.ndarray
    """[m, classes] bool."""


@dataclass
class FedPclServerState:
    w: Vector
    """The common initial model (FedPCL has no global model)."""
    prototypes: FedPclBroadcast


@dataclass
class FedPclUpload(Upload):
    """A client's local prototypes twice: weighted by its counts (summed over the clients, the numerator of the global
    prototypes) and in its own row of the [m, classes, d] table (summed, every uploader's row)."""

    weighted: np.ndarray
    """[classes, d] float64."""
    weight: np.ndarray
    """[classes] float64 (0 for a class the client does not hold)."""
    local: np.ndarray
    """[m, classes, d] float64: the client's prototypes in its row, zero elsewhere."""
    held: np.ndarray
    """[m, classes] float64: 1 in the client's row for the classes it holds."""


@ALGORITHMS.register()
class FedPcl(Algorithm[FedPclSettings, FedPclClientState, FedPclServerState, FedPclBroadcast, FedPclUpload]):
    name = "fedpcl"
    Settings = FedPclSettings
    Upload = FedPclUpload
    _encoder: np.ndarray | None = None

    def __init__(self, settings: FedPclSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.classes, self.dim = params.head_outputs, params.head_outputs
        self.head_mask = np.zeros(params.size, dtype=bool)
        for name in params.head:
            self.head_mask[params.slice(name)] = True

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """FedPCL on the meta partition, whose first held-back pool pretrains the encoder (one epoch)."""
        from raysim.data.meta_partition import MetaSettings

        return {"algorithm": {"name": cls.name, "teacher_epochs": 1}, **MetaSettings.example(context)}

    def server_data(self, context: ServerContext) -> ServerDataStep:
        """The pretrained encoder: a network of the clients' architecture from `teacher_weights` or pretrained on the
        meta partition's first held-back pool (raysim.algorithms.augfl.teacher.pretrained_parameters)."""
        if not self.settings.teacher_weights and len(context.pools) != 2:
            raise ConfigError(
                f"partition.scheme={context.partition}: FedPCL needs a frozen pretrained encoder: set "
                "algorithm.teacher_weights to a weights file of the clients' model (`raysim pretrain CONFIG --out "
                "FILE`), or use partition.scheme=meta, whose held-back pool pretrains one"
            )
        return pretrained_parameters(self.settings, context, context.model)

    def setup_server(self, data: np.ndarray) -> None:
        if data.shape != (self.params.size,):
            raise ValueError(f"FedPCL: the encoder has {data.size} parameters, the model {self.params.size}")
        self._encoder = data

    def init_server(self, init_params: Vector, num_clients: int) -> FedPclServerState:
        """w: the pretrained encoder with the initial (random) projection head of `init_params`."""
        if self._encoder is None:
            raise RuntimeError("FedPCL: setup_server was not called with the pretrained encoder")
        initial = np.where(self.head_mask, init_params, self._encoder).astype(np.float32)
        empty = FedPclBroadcast(
            initial,
            np.zeros((self.classes, self.dim), np.float32),
            np.zeros(self.classes, dtype=bool),
            np.zeros((num_clients, self.classes, self.dim), np.float32),
            np.zeros((num_clients, self.classes), dtype=bool),
        )
        return FedPclServerState(initial, empty)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedPclClientState:
        return FedPclClientState(
            init_params.copy(), np.zeros((self.classes, self.dim), np.float32), np.zeros(self.classes, dtype=bool)
        )

    def broadcast(self, server: FedPclServerState) -> FedPclBroadcast:
        return server.prototypes

    def contrast(self, broadcast: FedPclBroadcast) -> PrototypeContrast | None:
        """The loss of step 1: the global prototypes, then each known client's local ones (a class it does not hold
        from the global set), weighted 1 and 1/m; None before any prototype exists."""
        if not broadcast.present.any():
            return None
        known = np.flatnonzero(broadcast.held.any(axis=1))
        filled = np.where(broadcast.held[known, :, None], broadcast.local[known], broadcast.prototypes[None])
        sets = np.concatenate([broadcast.prototypes[None], filled]).astype(np.float32)
        weights = np.concatenate([[1.0], np.full(len(known), 1.0 / max(len(known), 1))])
        return PrototypeContrast(sets, broadcast.present.copy(), weights, self.settings.temperature)

    def client_step(self, client: ClientInfo, state: FedPclClientState, broadcast: FedPclBroadcast) -> ClientStep:
        s = self.settings
        theta = np.where(self.head_mask, state.theta, broadcast.initial).astype(np.float32)  # the frozen encoder
        loss = self.contrast(broadcast)
        train_loss: float | np.ndarray = 0.0
        if loss is not None:  # step 1: the projection only
            result = yield from train(s.local_sgd(theta, terms=(loss,), mask=self.head_mask))
            theta, train_loss = np.asarray(result.params, np.float32), result.mean_loss
        means = np.zeros((self.classes, self.dim))
        counts = np.zeros(self.classes)
        if client.num_train:  # step 2: the local prototypes
            local = yield from class_means(ClassMeans(theta, embedding=True))
            counts = local.counts
            means = means if local.means is None else local.means.astype(np.float64)
        held = counts > 0
        weight = counts if s.aggregation == "samples" else held.astype(np.float64)
        table = np.zeros((client.num_clients, self.classes, self.dim))
        rows = np.zeros((client.num_clients, self.classes))
        table[client.id], rows[client.id] = np.where(held[:, None], means, 0.0), held
        upload = FedPclUpload(weight[:, None] * means, weight, table, rows)
        new = FedPclClientState(theta, means.astype(np.float32), held)
        return ClientUpdate(new, upload, {"train_loss": float(train_loss), "classes_held": float(held.sum())})

    def server_step(self, server: FedPclServerState, total: FedPclUpload, num_selected: int):
        """Global prototypes: C_bar^(j) = sum_i w_ij C_i^(j) / sum_i w_ij over this round's uploaders holding class
        j; every uploader's local prototypes replace its last ones."""
        before = server.prototypes
        present = total.weight > 0
        prototypes = np.zeros_like(before.prototypes)
        prototypes[present] = (total.weighted[present] / total.weight[present, None]).astype(np.float32)
        uploaded = total.held.any(axis=1)
        local, held = before.local.copy(), before.held.copy()
        local[uploaded], held[uploaded] = total.local[uploaded].astype(np.float32), total.held[uploaded] > 0
        both = present & before.present
        change = np.linalg.norm(prototypes[both] - before.prototypes[both])
        metrics = {"global_change": float(change), "prototype_classes": float(present.sum())}
        return FedPclServerState(server.w, FedPclBroadcast(server.w, prototypes, present, local, held)), metrics

    def global_model(self, server: FedPclServerState) -> Vector:
        return server.w

    def personalized_model(self, state: FedPclClientState) -> Vector:
        """Nearest-local-prototype inference (module docstring); the plain network before the client's first step."""
        if not state.held.any():
            return state.theta
        return prototype_classifier(self.params, state.theta, state.prototypes, state.held, self.settings.temperature)

    def evaluation_context(self, server: FedPclServerState) -> FedPclBroadcast:
        return server.prototypes

    def extra_models(
        self, state: FedPclClientState, global_params: Vector, context: FedPclBroadcast | None = None
    ) -> dict[str, Vector]:
        """`proto`: the client's network with the nearest-global-prototype head."""
        if context is None or not context.present.any() or not state.held.any():
            return {}
        classifier = prototype_classifier(
            self.params, state.theta, context.prototypes, context.present, self.settings.temperature
        )
        return {"proto": classifier}

    def uplink_bytes(self, upload: FedPclUpload) -> int:
        """The prototype and the count of each class the client holds, as float32."""
        return 4 * int((upload.weight > 0).sum()) * (self.dim + 1)

    def downlink_bytes(self, broadcast: FedPclBroadcast) -> int:
        """The global prototypes that exist and every client's local prototypes, as float32."""
        return 4 * (int(broadcast.present.sum()) + int(broadcast.held.sum())) * self.dim


def prototype_classifier(
    params: ParamSpec, theta: Vector, prototypes: np.ndarray, present: np.ndarray, temperature: float
) -> Vector:
    """theta with its head (W, b) replaced by (P W / tau, P b / tau): logits <h, C_j> / tau, whose argmax is the
    prototype nearest in s(z, C) = <z, C> to z = h / ||h||; a class without a prototype gets the logit -1e9."""
    model = np.array(theta, dtype=np.float32, copy=True)
    weight_name = params.head[0]
    weight = model[params.slice(weight_name)].astype(np.float64).reshape(params.head_outputs, -1)
    centers = np.where(present[:, None], prototypes.astype(np.float64), 0.0) / temperature
    model[params.slice(weight_name)] = (centers @ weight).ravel()
    if len(params.head) > 1:
        bias = model[params.slice(params.head[1])].astype(np.float64)
        model[params.slice(params.head[1])] = np.where(present, centers @ bias, NO_PROTOTYPE_LOGIT)
    return model
