"""FedRoD: a class-balanced generic model with a personal head on top (Chen and Chao, ICLR 2022, arXiv:2107.00778).

"On Bridging Generic and Personalized Federated Learning for Image Classification"; a baseline of FedAPM's Table 4
(FedAPM, App. B.5.3, Table 4).

The model is split at its head (ParamSpec.head, the last linear layer): a shared body f and generic head g_G, both
averaged by the server as FedAvg averages a model, and a personal head g_P per client that never leaves it. A
selected client starts from the received body and generic head and runs local SGD on, per batch,

    BSM(g_G(f(x)), y) + CE(stopgrad(g_G(f(x))) + g_P(stopgrad(f(x))), y)

- the balanced softmax BSM(l, y) = CE(l + log n_i, y), n_i the client's class counts (Ren et al. 2020; the
  paper's Sec. 4 robust loss for the generic predictor, `generic_loss: balanced_softmax`; `ce`: plain CE), which
  trains f and g_G to the class-balanced objective every client shares;
- the personal head learns the residual of the client's own label distribution on top of the detached generic
  logits (the paper's personalized predictor, Sec. 4.2, eq. 5: logits g_G(z) + g_P(z)), as the implementation of
  FedCP's authors (TsingZ0/PFLlib clientrod.py) trains it, the gradient reaching neither f nor g_G. Both terms are
  taken in one forward pass per batch (PFLlib steps the body first and recomputes the features for the personal
  head).

The server averages the uploaded bodies and generic heads weighted by training samples. GM = body + generic head;
PM = body + generic head + personal head, i.e. the network whose head is g_G + g_P (both linear in the same
features, so their logits add). Uplink and downlink: the body and generic head (the whole model), never g_P.

The two-head loss is this module's term (`TwoHeadLoss`): its features come through FlatModel.features, one client at
a time (not stacked, `stacks = False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, weighted_average
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import ClassMeans, Vector, class_means, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.jit import distances
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel


@dataclass(frozen=True, eq=False)
class TwoHeadLoss(Term):
    """The local loss in place of f_i, on the vector (model, personal head) whose second part is laid out as the
    model's head (ParamSpec.head): CE(logits + logit_shift, y) + CE(stopgrad(logits) + g_P(stopgrad(z)), y), with z
    the model's features (its head's input) and g_P the personal head; `logit_shift` None: plain CE for the first."""

    logit_shift: np.ndarray | None
    """[classes]: log class counts (the balanced softmax), or None."""
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch import nn

        if model.task != "classification":
            raise ValueError(f"FedRoD's loss needs a classifier; model {model.name!r} is trained for {model.task}")
        with model.dropout(seed):
            features, logits = model.features(point[: model.size], x)
        # A copy (torch.tensor): the arrays may be read-only views of Ray's object store, which torch must not alias.
        shift = None if self.logit_shift is None else torch.tensor(np.asarray(self.logit_shift, np.float32))
        total = nn.functional.cross_entropy(logits if shift is None else logits + shift, y)
        head = model.spec_head(point[model.size :])
        corrected = logits.detach() + nn.functional.linear(features.detach(), *head)
        total = total + nn.functional.cross_entropy(corrected, y)
        return total


class FedRoDSettings(SGDSettings):
    name: Literal["fedrod"] = "fedrod"
    generic_loss: Literal["balanced_softmax", "ce"] = Field(
        "balanced_softmax",
        description="loss of the body and generic head: the balanced softmax CE(logits + log n_i, y) with the "
        "client's class counts n_i (the paper's robust loss), or plain cross-entropy",
    )
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weight the uploaded bodies and generic heads by training-set size or equally"
    )


@dataclass
class FedRoDClientState:
    personal_head: Vector
    """g_P, laid out as the model's head (ParamSpec.head: weight, then bias); zero before the first round."""


@dataclass
class FedRoDServerState:
    w: Vector
    """Body and generic head."""


def class_prior_shift(counts: np.ndarray) -> np.ndarray | None:
    """log n_c per class, -inf for a class the client does not hold (the balanced softmax's logit shift); None when
    no count is known (a client that reports no data)."""
    if counts.size == 0 or not np.any(counts > 0):
        return None
    return np.where(counts > 0, np.log(np.maximum(counts, 1.0)), -np.inf).astype(np.float32)


@ALGORITHMS.register()
class FedRoD(Algorithm[FedRoDSettings, FedRoDClientState, FedRoDServerState, Vector, WeightedUpload]):
    name = "fedrod"
    Settings = FedRoDSettings
    Upload = WeightedUpload

    def __init__(self, settings: FedRoDSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.head = params.head_mask()

    def init_server(self, init_params: Vector, num_clients: int) -> FedRoDServerState:
        return FedRoDServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedRoDClientState:
        return FedRoDClientState(np.zeros(int(self.head.sum()), np.float32))

    def broadcast(self, server: FedRoDServerState) -> Vector:
        return server.w

    def client_step(self, client: ClientInfo, state: FedRoDClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        shift = None
        if s.generic_loss == "balanced_softmax":
            counts = yield from class_means(ClassMeans(None))
            shift = class_prior_shift(counts.counts)
        start = np.concatenate([broadcast, state.personal_head]).astype(np.float32)
        result = yield from train(s.local_sgd(start, terms=(TwoHeadLoss(shift),)))
        params = np.asarray(result.params, np.float32)
        model, personal = params[: len(broadcast)], params[len(broadcast) :]
        weight = float(client.num_train) if s.aggregation == "samples" else 1.0
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": distances(model, broadcast),
            "personal_head_norm": float(np.linalg.norm(personal)),
        }
        upload = WeightedUpload(weight * model.astype(np.float64), weight)
        return ClientUpdate(FedRoDClientState(personal.copy()), upload, metrics)

    def server_step(self, server: FedRoDServerState, total: WeightedUpload, num_selected: int):
        w, metrics = weighted_average(total, server.w)  # sum_i n_i (f_i, g_G,i) / sum_i n_i
        return FedRoDServerState(w), metrics

    def global_model(self, server: FedRoDServerState) -> Vector:
        return server.w

    def evaluated_model(self, state: FedRoDClientState, global_params: Vector) -> Vector:
        """PM: the current body with the head g_G + g_P (the logits g_G(z) + g_P(z), eq. 5)."""
        model = global_params.copy()
        model[self.head] += state.personal_head
        return model
