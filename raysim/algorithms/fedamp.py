"""FedAMP: federated attentive message passing (Huang, Chu, Zhou, Wang, Liu, Pei and Zhang, "Personalized
Cross-Silo Federated Learning on Non-IID Data", AAAI 2021, arXiv:2007.03797, Algorithm 1).

Each client i keeps its personalized model w_i; the server keeps every client's latest w_j (`reads_messages`) and
computes for each client a personalized cloud model, one gradient step of the attention-inducing penalty
A(W) = sum_{i<j} A(||w_i - w_j||^2) (eq. 7-8):

    u_i = sum_j xi_ij w_j,   xi_ij = alpha_k A'(||w_i - w_j||^2) (j != i),   xi_ii = 1 - sum_{j != i} xi_ij,

with A(x) = 1 - exp(-x / sigma), so A'(x) = exp(-x / sigma) / sigma (the paper's choice): the closer two models,
the more they pull on each other. The rows of xi sum to 1; they are a convex combination while
alpha_k <= sigma / (m - 1) (A' <= 1 / sigma), and the server logs the smallest self weight (`server/self_weight_min`).
A selected client receives only its own u_i (one model down), minimizes f_i(w) + lambda / (2 alpha_k) ||w - u_i||^2
by local SGD from u_i (eq. 9, the Prox term) and uploads the result, its new w_i (one model up), which it keeps as
its PM. A fixed point of the two steps is a stationary point of sum_i f_i(w_i) + (lambda / 2) sum_{i<j}
A(||w_i - w_j||^2), whatever alpha_k. The GM (FedAMP has none) is the mean of the clients' latest models on the
server. Defaults alpha_k = lambda = sigma = 1, constant over rounds: PFLlib's (TsingZ0/PFLlib system/main.py; the
paper tunes them per data set). Their weights need not be a convex combination: 10 MLPs one epoch
from a common start are ||w_i - w_j||^2 ~ 1 apart, and xi_ii ~ -3 extrapolates; alpha_k <= sigma / (m - 1) keeps
it convex, and lr * lambda / alpha_k < 2 keeps the local step on the pull stable.

Switches, the paper's behaviour by default:
- `attention: cosine` is the paper's HeurFedAMP for deep networks (and PFLlib's former serverhamp.py): a fixed self
  weight xi_ii = `self_weight` and xi_ij = (1 - xi_ii) softmax_{j != i}(sigma cos(w_i, w_j)); sigma is then the
  softmax's scale (PFLlib's scripts: sigma = 0.1, xi = 0.1). PFLlib's serveramp.py today is the paper's attention.
- `start: personal` starts the local SGD from the client's own w_i (PFLlib and fluke keep the client's model
  across rounds) instead of from u_i; eq. 9 is an argmin, which the start does not change for a convex f_i.
- `peers: selected` attends only to the models uploaded in the last round (PFLlib's `uploaded_models`) instead of
  every client's latest (the paper's full participation of cross-silo clients, where the two coincide).
PFLlib's client adds (lambda / (2 alpha_k)) ||w - u_i|| (a norm, not its square) to its loss; this module follows
eq. 9. The uploads name no message field: Byzantine attacks and robust rules, which replace the mean of models,
are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerReadsEachMessage,
    Upload,
    payload_bytes,
    server_metrics,
)
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Prox


class FedAmpSettings(SGDSettings):
    name: Literal["fedamp"] = "fedamp"
    alpha_k: float = Field(
        1.0, gt=0, description="alpha_k: the server's step on the attention penalty (eq. 7); xi_ij = alpha_k A'"
    )
    lam: float = Field(
        1.0, ge=0, alias="lambda", description="lambda: the pull lambda / (2 alpha_k) ||w - u_i||^2 of eq. 9"
    )
    sigma: float = Field(
        1.0, gt=0, description="sigma: A'(x) = exp(-x / sigma) / sigma; with attention cosine the softmax's scale"
    )
    attention: Literal["paper", "cosine"] = Field(
        "paper",
        description="paper: xi_ij = alpha_k A'(||w_i - w_j||^2) (eq. 8); cosine: HeurFedAMP, xi_ii = self_weight "
        "and xi_ij = (1 - self_weight) softmax_j(sigma cos(w_i, w_j))",
    )
    self_weight: float = Field(
        0.1, ge=0, le=1, description="xi_ii of attention cosine (HeurFedAMP; PFLlib's scripts: 0.1)"
    )
    start: Literal["cloud", "personal"] = Field(
        "cloud", description="local SGD starts from u_i (cloud) or from the client's own w_i (personal: PFLlib)"
    )
    peers: Literal["all", "selected"] = Field(
        "all",
        description="u_i attends to every client's latest model (all: the paper) or only to those uploaded in the "
        "last round (selected: PFLlib)",
    )


@dataclass
class FedAmpBroadcast:
    clouds: Vector
    """[m, n]: each client's cloud model u_i; a client reads (and is counted for) its own row."""


@dataclass
class FedAmpUpload(Upload):
    """The client's new w_i. It names no message field: the server reads it by client (`message`)."""

    model: Vector


@dataclass
class FedAmpClientState:
    personal: Vector
    """w_i after its last step (the initial model before)."""


@dataclass
class FedAmpServerState:
    models: Vector
    """[m, n]: every client's latest w_j (the initial model until it first uploads)."""
    clouds: Vector
    """[m, n]: every client's u_i from `models` (eq. 8), for the next round."""


def attention(models: np.ndarray, peers: np.ndarray, settings: FedAmpSettings) -> np.ndarray:
    """xi [m, m] (float64, rows summing to 1) over the rows of `models`; client i attends to the clients j != i
    with peers[j] (eq. 8, or HeurFedAMP's cosine softmax)."""
    w = np.asarray(models, np.float64)
    gram = w @ w.T
    squares = np.diag(gram)
    m = len(w)
    others = peers[None, :] & ~np.eye(m, dtype=bool)
    if settings.attention == "paper":
        distances = np.maximum(squares[:, None] + squares[None, :] - 2 * gram, 0.0)
        off = np.where(others, settings.alpha_k * np.exp(-distances / settings.sigma) / settings.sigma, 0.0)
        xi = off.copy()
        np.fill_diagonal(xi, 1.0 - off.sum(axis=1))
        return xi
    norms = np.maximum(np.sqrt(squares), 1e-12)
    logits = np.where(others, settings.sigma * gram / np.outer(norms, norms), -np.inf)
    has_peer = others.any(axis=1)
    shifted = np.exp(logits - np.where(has_peer, logits.max(axis=1), 0.0)[:, None])
    off = (1.0 - settings.self_weight) * shifted / np.where(has_peer, shifted.sum(axis=1), 1.0)[:, None]
    xi = off.copy()
    np.fill_diagonal(xi, np.where(has_peer, settings.self_weight, 1.0))
    return xi


@ALGORITHMS.register()
class FedAmp(
    ServerReadsEachMessage[FedAmpSettings, FedAmpClientState, FedAmpServerState, FedAmpBroadcast, FedAmpUpload]
):
    """Personalized models that pull on each other in proportion to their similarity, through cloud models."""

    name = "fedamp"
    Settings = FedAmpSettings
    Upload = FedAmpUpload

    def init_server(self, init_params: Vector, num_clients: int) -> FedAmpServerState:
        models = np.tile(np.asarray(init_params, np.float32), (num_clients, 1))
        return FedAmpServerState(models, models)  # identical models: u_i = w_i, and neither is changed in place

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedAmpClientState:
        return FedAmpClientState(init_params)  # shared and read-only until the first step replaces it

    def broadcast(self, server: FedAmpServerState) -> FedAmpBroadcast:
        return FedAmpBroadcast(server.clouds)

    def downlink_bytes(self, broadcast: FedAmpBroadcast) -> int:
        """One cloud model: each client receives its own u_i."""
        return payload_bytes(broadcast.clouds[0])

    def client_step(self, client: ClientInfo, state: FedAmpClientState, received: FedAmpBroadcast) -> ClientStep:
        """w_i = argmin f_i(w) + lambda / (2 alpha_k) ||w - u_i||^2 by local SGD (eq. 9)."""
        s = self.settings
        cloud = received.clouds[client.id]
        start = cloud if s.start == "cloud" else state.personal
        result = yield from train(s.local_sgd(start, terms=(Prox(cloud, s.lam / s.alpha_k),)))
        personal = np.array(result.params, np.float32)
        metrics = {"train_loss": result.mean_loss, "cloud_gap": float(np.linalg.norm(personal - cloud))}
        return ClientUpdate(FedAmpClientState(personal), FedAmpUpload(personal.astype(np.float64)), metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """The client's new w_i, which the server reads by client."""
        return update.upload.model

    def server_step_by_client(
        self, server: FedAmpServerState, total: FedAmpUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[FedAmpServerState, dict[str, float]]:
        """Store the uploaded w_i, then every client's cloud model u_i = sum_j xi_ij w_j (eq. 7-8)."""
        models = server.models.copy()
        for client, model in messages.items():
            models[client] = model
        if self.settings.peers == "all":
            peers = np.ones(len(models), bool)
        else:
            peers = np.zeros(len(models), bool)
            peers[list(messages)] = True
        xi = attention(models, peers, self.settings)
        clouds = (xi @ models.astype(np.float64)).astype(np.float32)
        self_weights = np.diag(xi)
        metrics = {
            **server_metrics(self.global_model_of(models), self.global_model_of(server.models)),
            "self_weight_min": float(self_weights.min()),
            "self_weight_mean": float(self_weights.mean()),
        }
        return FedAmpServerState(models, clouds), metrics

    @staticmethod
    def global_model_of(models: Vector) -> Vector:
        """The mean of the clients' latest models."""
        return np.asarray(models, np.float64).mean(axis=0).astype(np.float32)

    def global_model(self, server: FedAmpServerState) -> Vector:
        return self.global_model_of(server.models)

    def personalized_model(self, state: FedAmpClientState) -> Vector:
        return state.personal
