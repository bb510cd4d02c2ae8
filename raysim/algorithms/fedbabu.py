"""FedBABU: federated training of the body alone, the head frozen at its random initialization, then fine-tuning
for personalization (Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022, arXiv:2106.06042, Algorithm 1).

Every client shares the one randomly initialized head theta_h, which is never trained during federated training.
A selected client trains the body from the received one with the head frozen,

    theta_b,i <- `epochs` epochs of SGD over theta_b on f_i(theta_b, theta_h)                   (Algorithm 1)

and uploads it; the server averages the bodies weighted by n_i (FedAvg's weights; `aggregation: uniform` for
equal ones). The GM is the averaged body with the initial head. A client's PM is the received model fine-tuned on
its training split for `finetune_epochs` epochs, head and body together (the paper's personalization, Sec. 4.1:
tau_f = 5 epochs at the training lr), computed at the start of its step, so it lags the logged GM by the rounds
since the client last trained (as Per-FedAvg's adaptation); a held-out client fine-tunes the current GM at each
evaluation. Communication: the body both ways (the head is fixed and known to all).

The head is `personal` (fnmatch patterns) or `preset` (`last_layer` by default: the classifier, the paper's and
FL-bench's). `finetune_epochs: 0` scores the GM itself as the PM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.families.split import Preset, SplitSettings, personal_mask
from raysim.algorithms.interface import (
    ALGORITHMS,
    AdaptStep,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    payload_bytes,
)
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.jit import distances
from raysim.models.spec import ParamSpec


class FedBabuSettings(SGDSettings, SplitSettings):
    name: Literal["fedbabu"] = "fedbabu"
    preset: Preset = Field("last_layer", description="the frozen head: last_layer (the classifier) or a preset")
    finetune_epochs: int = Field(
        5, ge=0, description="tau_f: epochs of fine-tuning the whole model for the PM (the paper's 5); 0: the GM"
    )
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weights of the bodies' average: n_i (FedAvg's) or equal"
    )


@dataclass
class FedBabuClientState:
    personal: Vector
    """The PM: the model received at the client's last step, fine-tuned on its training split."""


@dataclass
class FedBabuServerState:
    w: Vector
    """The global model: the averaged body and the initial head."""


@ALGORITHMS.register()
class FedBabu(Algorithm[FedBabuSettings, FedBabuClientState, FedBabuServerState, Vector, WeightedUpload]):
    """The body federated with the head frozen at its initialization; the PM a fine-tuning of the received model."""

    name = "fedbabu"
    Settings = FedBabuSettings
    Upload = WeightedUpload
    scales_loss = True

    def __init__(self, settings: FedBabuSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.head = personal_mask(settings, params)
        self.body = ~self.head

    def init_server(self, init_params: Vector, num_clients: int) -> FedBabuServerState:
        return FedBabuServerState(init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedBabuClientState:
        return FedBabuClientState(init_params)  # shared and read-only until the first step replaces it

    def broadcast(self, server: FedBabuServerState) -> Vector:
        """The global model; only its body counts as sent (`downlink_bytes`): the head is the initial one, which
        every client holds."""
        return server.w

    def downlink_bytes(self, broadcast: Vector) -> int:
        return payload_bytes(broadcast[self.body])

    def client_step(self, client: ClientInfo, state: FedBabuClientState, start: Vector) -> ClientStep:
        s = self.settings
        personal = yield from self.finetuned(start)
        result = yield from train(s.scaled(s.local_sgd(start, mask=self.body), client.num_clients))
        params = np.asarray(result.params, np.float32)
        weight = upload_weight(client.num_train, s.aggregation)
        metrics = {"train_loss": result.mean_loss, "update_norm": distances(params, start)}
        return ClientUpdate(FedBabuClientState(personal), WeightedUpload(weight * params[self.body], weight), metrics)

    def finetuned(self, model: Vector) -> AdaptStep:
        """`finetune_epochs` epochs of SGD on the whole model from `model` (the PM); `model` itself for 0."""
        s = self.settings
        if not s.finetune_epochs:
            return model
        tuned = yield from train(s.local_sgd(model, s.finetune_epochs))
        return np.asarray(tuned.params, np.float32)

    def server_step(self, server: FedBabuServerState, total: WeightedUpload, num_selected: int):
        body, metrics = weighted_average(total, server.w[self.body])  # sum_i a_i theta_b,i / sum_i a_i
        w = server.w.copy()
        w[self.body] = body
        return FedBabuServerState(w), metrics

    def global_model(self, server: FedBabuServerState) -> Vector:
        return server.w

    def personalized_model(self, state: FedBabuClientState) -> Vector:
        return state.personal

    def adapt(self, client: ClientInfo, global_params: Vector) -> AdaptStep:
        """A held-out client's PM: the current GM fine-tuned on its training split."""
        return (yield from self.finetuned(global_params))

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.body]
