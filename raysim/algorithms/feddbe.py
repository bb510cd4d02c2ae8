"""FedDBE: FedAvg with a Domain Bias Eliminator (Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan: "Eliminating Domain
Bias for Federated Learning in Representation Space", NeurIPS 2023, arXiv:2311.14975).

The network is split at its head (ParamSpec.head, the last linear layer): a feature extractor f (the body) whose
output z^g = f(x) (size d) is the head's input, and the head h (W, b). DBE adds two modules (Sec. 4):

- PRBM, the Personalized Representation Bias Memory: a vector zbar_i^p of size d that client i keeps and never
  sends, added to the features before the head, so that the client's model is h(f(x) + zbar_i^p). It starts at 0
  and trains with the model, at the same learning rate (the authors' separate SGD optimizer on it).
- MR, Mean Regularization: a pull of the mean of the client's features towards the consensus zbar^g, the mean
  representation over the clients' data. A selected client trains body, head and zbar_i^p by local SGD on, per
  batch of B samples,

      CE(h(f(x) + zbar_i^p), y) + kappa * (1 / 2d) * ||zbar_i^g - zbar^g||^2,   zbar_i^g = (1/B) sum_b f(x_b)

  (MR's distance as the authors' code takes it: half the mean over the d coordinates of the squared difference).
  With `mean_momentum` m < 1, zbar_i^g is a running mean over the round's batches instead,
  m * (this batch's mean) + (1 - m) * (the previous running mean, no gradient), restarted at 0 every round
  (PFLlib's default m = 0.1); m = 1 (the authors' run_me.sh, `-mo 1`) is the batch's own mean.

The consensus zbar^g is made once, in the initialization period before training proper, and stays fixed (as the
authors' serverdbe.py / serverDBE.py make it): here that period is round 0. With no consensus yet, a selected
client trains as FedAvg (plain CE, zbar_i^p neither used nor trained: the code's `global_mean is None` branch), then
computes its mean representation over its whole training split at its trained model and uploads it with its sample
count; the server sets zbar^g = sum_i n_i zbar_i^g / sum_i n_i over those clients. Departures from the code, for
raysim's protocol: its initialization period is an extra local epoch whose models are thrown away, and each client's
mean is the running mean of its batches during it; here it is round 0, whose models are averaged as any round's,
and the mean is taken over the training split afterwards (ClassMeans). With partial participation the consensus is
that of round 0's selected clients (the code's period has every client); a round whose clients hold no data leaves
it for the next round.

The server averages bodies and heads as FedAvg, weighted by training samples (`aggregation`). GM = body + head;
PM = body + head applied to f(x) + zbar_i^p, which, the head being linear, is the network whose head bias is
b + W zbar_i^p (a head without a bias cannot hold it: such a model is refused). A held-out client, and one never
selected, has zbar_i^p = 0: its PM is the GM. Uplink: the model and its weight, and in the initialization round the
mean representation and its weight (d + 1); downlink: the model, and once the consensus exists, zbar^g (d). The
upload's message is the model, so attacks and robust rules act on it (not on the round-0 mean). `kappa: 0` switches
MR off and `prbm: false` the PRBM (zbar_i^p frozen at 0); both off is FedAvg.

The text of the paper's Sec. 4 was not at hand here: the forms above are those of the authors' code (TsingZ0/DBE
clientDBE.py / serverDBE.py, the same in TsingZ0/PFLlib clientdbe.py / serverdbe.py), so no equation numbers are
cited; the defaults kappa = 50 and m = 1 are those of the authors' run_me.sh (FMNIST, 4-layer CNN, lr 0.005, batch 10,
one local epoch, 20 clients, full participation).

The loss is this module's term (`DomainBiasLoss`): its features come through FlatModel.features, one client at a
time (not stacked, `stacks = False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import upload_weight, weighted_average
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate, Upload
from raysim.algorithms.requests import ClassMeans, Vector, class_means, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.errors import ConfigError
from raysim.jit import distances
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel


@dataclass(frozen=True, eq=False)
class DomainBiasLoss(Term):
    """The local loss in place of f_i, on the vector (model, zbar_i^p) whose second part has the features' size d:

        CE(h(z + zbar_i^p), y) + kappa * (1 / 2d) * ||running - global_mean||^2

    with z = f(x) the model's features on the batch, h its head and running = m * mean_b z_b + (1 - m) * (the
    previous batch's running, detached; 0 at the request's first batch), m = `mean_momentum`. The running mean is
    kept across the steps of the request this term belongs to (one term per request)."""

    global_mean: np.ndarray
    """[d]: the consensus zbar^g."""
    kappa: float
    mean_momentum: float = 1.0
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch import nn

        if model.task != "classification":
            raise ValueError(f"FedDBE's loss needs a classifier; model {model.name!r} is trained for {model.task}")
        network, memory = point[: model.size], point[model.size :]
        with model.dropout(seed):
            features, logits = model.features(network, x)
        weight = network[model.spec.slice(model.spec.head[0])].reshape(model.head.weight.shape)
        total = nn.functional.cross_entropy(logits + nn.functional.linear(memory, weight), y)  # h(z + zbar_i^p)
        if self.kappa:
            batch_mean = features.reshape(-1, memory.numel()).mean(dim=0)
            running = self._running(batch_mean)
            total = total + self.kappa * 0.5 * torch.mean((running - self.tensor("global_mean")) ** 2)
        return total

    def _running(self, batch_mean: torch.Tensor) -> torch.Tensor:
        """m * batch_mean + (1 - m) * the previous step's running mean (detached), remembered for the next step."""
        if self.mean_momentum == 1.0:
            return batch_mean
        previous = self.__dict__.get("_running_mean")
        running = self.mean_momentum * batch_mean
        if previous is not None:
            running = running + (1.0 - self.mean_momentum) * previous
        self.__dict__["_running_mean"] = running.detach()
        return running


class FedDBESettings(SGDSettings):
    name: Literal["feddbe"] = "feddbe"
    kappa: float = Field(
        50.0,
        ge=0,
        description="kappa: weight of the mean regularization (MR) of the features' mean towards the consensus, "
        "kappa/(2d) ||zbar_i^g - zbar^g||^2 (50 in the authors' run_me.sh, `-klw 50`; 0: no MR)",
    )
    mean_momentum: float = Field(
        1.0,
        gt=0,
        le=1,
        description="m: MR's zbar_i^g is m * the batch's mean features + (1 - m) * the running mean of the round's "
        "earlier batches (1: the batch's own mean, the authors' run_me.sh `-mo 1`; PFLlib's default 0.1)",
    )
    prbm: bool = Field(
        True,
        description="train the personalized representation bias memory zbar_i^p added to the features (false: "
        "it stays 0; with kappa 0 that is FedAvg)",
    )
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weight the uploaded models by training-set size (the authors' code) or equally"
    )


@dataclass
class FedDBEClientState:
    memory: Vector
    """zbar_i^p, the PRBM: [d] float32, 0 before the client's first training round; never sent."""


@dataclass
class FedDBEBroadcast:
    w: Vector
    """The global body and head."""
    global_mean: Vector | None
    """zbar^g, [d] float32; None before the initialization round has made it."""


@dataclass
class FedDBEServerState:
    w: Vector
    global_mean: Vector | None = None
    """zbar^g, fixed once made (None before)."""


@dataclass
class FedDBEUpload(Upload):
    """A client's weighted model a_i theta_i and weight a_i (the message attacks and robust rules act on), and in
    the initialization round its mean representation times its training-sample count and that count (zeros after)."""

    weighted: Vector
    weight: float
    mean_weighted: Vector
    """[d] float64: n_i zbar_i^g (zeros when not sent)."""
    mean_weight: float
    """n_i, or 0 when no mean representation is sent."""
    message_field = "weighted"
    weight_field = "weight"


@ALGORITHMS.register()
class FedDBE(Algorithm[FedDBESettings, FedDBEClientState, FedDBEServerState, FedDBEBroadcast, FedDBEUpload]):
    name = "feddbe"
    Settings = FedDBESettings
    Upload = FedDBEUpload

    def __init__(self, settings: FedDBESettings, params: ParamSpec):
        super().__init__(settings, params)
        if len(params.require_head()) < 2:
            raise ConfigError(
                f"algorithm.name=feddbe scores each client's model with its representation bias folded into the head's "
                f"bias, and the head of model {params.model or '(unnamed)'!r} has none: choose a model whose last "
                "linear layer has a bias"
            )
        self.dim = params.feature_dim
        self.weight_slice = params.slice(params.head[0])
        self.bias_slice = params.slice(params.head[1])

    def init_server(self, init_params: Vector, num_clients: int) -> FedDBEServerState:
        return FedDBEServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedDBEClientState:
        return FedDBEClientState(np.zeros(self.dim, np.float32))

    def broadcast(self, server: FedDBEServerState) -> FedDBEBroadcast:
        return FedDBEBroadcast(server.w, server.global_mean)

    def client_step(self, client: ClientInfo, state: FedDBEClientState, broadcast: FedDBEBroadcast) -> ClientStep:
        s = self.settings
        weight = float(upload_weight(client.num_train, s.aggregation))
        mean_weighted, mean_weight = np.zeros(self.dim), 0.0
        if broadcast.global_mean is None:  # the initialization period: FedAvg, then the mean representation
            result = yield from train(s.local_sgd(broadcast.w))
            model, memory = np.asarray(result.params, np.float32), state.memory
            if client.num_train:
                local = yield from class_means(ClassMeans(model))
                if local.means is not None and local.counts.sum() > 0:
                    mean_weighted = local.counts @ local.means.astype(np.float64)  # n_i zbar_i^g
                    mean_weight = float(local.counts.sum())
        else:
            loss = DomainBiasLoss(broadcast.global_mean, s.kappa, s.mean_momentum)
            start = np.concatenate([broadcast.w, state.memory]).astype(np.float32)
            mask = None
            if not s.prbm:
                mask = np.concatenate([np.ones(broadcast.w.size, bool), np.zeros(self.dim, bool)])
            result = yield from train(s.local_sgd(start, terms=(loss,), mask=mask))
            trained = np.asarray(result.params, np.float32)
            model, memory = trained[: broadcast.w.size], trained[broadcast.w.size :].copy()
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": distances(model, broadcast.w),
            "prbm_norm": float(np.linalg.norm(memory)),
        }
        upload = FedDBEUpload(weight * model.astype(np.float64), weight, mean_weighted, mean_weight)
        return ClientUpdate(FedDBEClientState(memory), upload, metrics)

    def server_step(self, server: FedDBEServerState, total: FedDBEUpload, num_selected: int):
        """w = sum_i a_i theta_i / sum_i a_i; zbar^g = sum_i n_i zbar_i^g / sum_i n_i the first time means arrive."""
        w, metrics = weighted_average(total, server.w)
        global_mean = server.global_mean
        if global_mean is None and total.mean_weight > 0:
            global_mean = (np.asarray(total.mean_weighted) / total.mean_weight).astype(np.float32)
        if global_mean is not None:
            metrics["consensus_norm"] = float(np.linalg.norm(global_mean))
        return FedDBEServerState(w, global_mean), metrics

    def global_model(self, server: FedDBEServerState) -> Vector:
        return server.w

    def evaluated_model(self, state: FedDBEClientState, global_params: Vector) -> Vector:
        """PM: the current body and head on z + zbar_i^p, i.e. the head's bias b + W zbar_i^p."""
        model = global_params.copy()
        weight = global_params[self.weight_slice].astype(np.float64).reshape(-1, self.dim)
        model[self.bias_slice] += (weight @ state.memory.astype(np.float64)).astype(np.float32)
        return model

    def uplink_bytes(self, upload: FedDBEUpload) -> int:
        """The model and its weight, and the mean representation and its count when sent, as float32."""
        sent = upload.weighted.size + 1
        return 4 * (sent + (self.dim + 1 if upload.mean_weight > 0 else 0))

    def downlink_bytes(self, broadcast: FedDBEBroadcast) -> int:
        """The model, and zbar^g once it exists, as float32."""
        return 4 * (broadcast.w.size + (0 if broadcast.global_mean is None else self.dim))
