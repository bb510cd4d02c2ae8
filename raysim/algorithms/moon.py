"""MOON: model-contrastive federated learning (Li, He and Song, CVPR 2021), FedAvg whose local objective pulls a
sample's representation towards the global model's and away from the client's previous model's.

A selected client trains from the received w^t on, per mini-batch (eq. 3 of the paper),

    l = CE(w; x, y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

with z the representation of x under the model being trained, z_glob under the received global model, z_prev under
the client's own model after its previous round (the initial model before its first), sim the cosine similarity
and tau the temperature. The representation is the network's features, the input of its last linear layer
(ParamSpec.head; the paper adds a projection head to its CNNs, FL-bench uses the features as here). The server
takes FedAvg's weighted mean of the selected clients' models; the deployed model is the global one. mu = 0 is FedAvg.
Defaults: mu 1 and tau 0.5 (the paper tunes mu per dataset: 5 on CIFAR-10, FL-bench's default, 1 on CIFAR-100
and Tiny-ImageNet; tau 0.5 throughout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.jit import distances

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel


@dataclass(frozen=True, eq=False)
class ModelContrast(Term):
    """In place of f_i on a batch: CE(logits, y) + mu * l_con (eq. 3), l_con the cross-entropy of the logits
    (sim(z, z_glob), sim(z, z_prev)) / tau towards the first; the two reference models' features are constants."""

    global_model: np.ndarray
    """w^t, shared by every client of a chunk."""
    previous: np.ndarray
    """The client's own model after its previous round."""
    mu: float
    temperature: float
    rows: ClassVar[tuple[str, ...]] = ("previous",)
    shared: ClassVar[tuple[str, ...]] = ("global_model",)
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch.nn import functional

        with torch.no_grad():
            z_global, _ = model.features(self.tensor("global_model"), x)
            z_previous, _ = model.features(self.tensor("previous"), x)
        with model.dropout(seed):
            z, logits = model.features(point, x)
        similarities = torch.stack(
            [functional.cosine_similarity(z, z_global, dim=1), functional.cosine_similarity(z, z_previous, dim=1)], 1
        )
        contrast = functional.cross_entropy(similarities / self.temperature, torch.zeros_like(y))
        total = functional.cross_entropy(logits, y) + self.mu * contrast
        return total


class MoonSettings(SGDSettings):
    name: Literal["moon"] = "moon"
    mu: float = Field(1.0, ge=0, description="weight of the model-contrastive loss (0: FedAvg)")
    temperature: float = Field(0.5, gt=0, description="tau: temperature of the contrastive loss")
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weight the uploaded models by training-set size (FedAvg's) or equally"
    )


@dataclass
class MoonClientState:
    previous: Vector
    """The client's model after its last round (the initial model before its first)."""


@dataclass
class MoonServerState:
    w: Vector


@ALGORITHMS.register()
class Moon(Algorithm[MoonSettings, MoonClientState, MoonServerState, Vector, WeightedUpload]):
    name = "moon"
    Settings = MoonSettings
    Upload = WeightedUpload

    def init_server(self, init_params: Vector, num_clients: int) -> MoonServerState:
        return MoonServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> MoonClientState:
        return MoonClientState(init_params.copy())

    def broadcast(self, server: MoonServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo, state: MoonClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        contrast = ModelContrast(broadcast, state.previous, s.mu, s.temperature)
        result = yield from train(s.local_sgd(broadcast, terms=(contrast,)))
        params = np.asarray(result.params, np.float32)
        weight = upload_weight(client.num_train, s.aggregation)
        metrics = {"train_loss": result.mean_loss, "update_norm": distances(params, broadcast)}
        return ClientUpdate(MoonClientState(params.copy()), WeightedUpload(weight * params, weight), metrics)

    def server_step(self, server: MoonServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # sum_i n_i theta_i / sum_i n_i
        return MoonServerState(w), metrics

    def global_model(self, server: MoonServerState) -> Vector:
        return server.w
