"""APPLE: each client learns how much of every other client's model to take into its own (Luo and Wu, "Adapt to
Adaptation: Learning Personalization for Cross-Silo Federated Learning", IJCAI 2022, arXiv:2110.08394; the
authors' code is ljaiverson/pFL-APPLE, PFLlib has a port).

Every client j trains a core model theta_j, which it uploads; the server keeps all m clients' latest core models
(`reads_messages`). Client i's personalized model is a combination of all of them,

    pm_i = sum_j p_ij theta_j,

weighted by its directed relationship (DR) vector p_i (m numbers it keeps; p_ij need not be positive nor sum to 1).
A selected client receives the others' core models and runs `local_steps` steps (default about `epochs` passes,
`batch_steps`), each on one fresh batch (BatchGradients) of its loss f_i at pm_i plus the loss scheduler's proximal
term lambda(r) (mu / 2) ||p_i - p_0||^2, both updates with the step's start values (the chain rule through pm_i):

    g      = grad f_i(pm_i)
    theta_i <- theta_i - eta_1 p_ii g                                         (only its own core model moves)
    p_ij    <- p_ij - eta_2 (<g, theta_j> + lambda(r) mu (p_ij - p_0j))       (for every j, its own included)

with SGD momentum on both when `momentum` > 0 (the authors' code: 0.9, reset every round). p_0 is FedAvg's weighting
of the clients, the paper's p_0j = n_j / n: here the clients' weights alpha_j of `clients.weighting` (1/m by
default; n_j / n with `samples`), normalized; p_i starts there. The loss scheduler lambda(r) lowers the pull
towards p_0, and so the focus moves from the global objective (pm_i near the FedAvg average of the core models) to
the local one, over the first L rounds (`decay_rounds`): lambda(r) = (cos(pi r / L) + 1) / 2 (`cosine`, PFLlib and
FLGo) or 0.001^(r / L) (`exponential`, the authors' code's default), and 0 from round L on; r is the server's
round, 0 first.

Messages and accounting. A client sends theta_i and its weight alpha_i (the server learns each alpha_j this way:
with `samples` weighting, p_0 is exact once every client has uploaded, a client not heard from counting 1/m until
then). A selected client receives the m - 1 other core models (its own it keeps) and p_0: the paper's full
participation, where every core model changes every round; with partial participation this is an upper bound, a
client that kept its copies needing only those changed since it last trained (the paper's note). The server's
round number is not counted (a cross-silo client knows it).

Models. The PM is pm_i as the client holds it after its step, with its trained theta_i and the core models it
received (the authors' evaluation of their ClientNet after the round); before its first step a client deploys the
GM, which is its pm_i at p_i = p_0. The GM is sum_j p_0j theta_j over the server's latest core models (the mean
with uniform weighting). With p_i = e_i and eta_2 = 0, pm_i = theta_i and the step is local training.

Paper and libraries: PFLlib starts p_i at 1/m (not p_0), scales its core learning rate by m (p_ii ~ 1/m), takes
lambda of the previous round, and uses as the DR gradient the mean over the layers of each layer's mean of
g * theta_j (`p_gradient: layer_mean`) instead of the inner product (`exact`, the chain rule and the authors'
autograd); the authors' code regularizes by lambda(r) mu ||p_i - p_0||^2 (twice this module's pull for the same
mu). Defaults: eta_1 = 0.01, eta_2 = 0.001, mu = 0.1, the authors' code's (and FLGo's), L = 16 (the authors' code:
a tenth of its 160 rounds; PFLlib: all rounds). The messages are not averaging messages: Byzantine attacks and
robust rules are refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerReadsEachMessage,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import BatchGradients, Number, Vector, batch_gradients, mean_over_steps
from raysim.algorithms.settings import LocalStepsSettings
from raysim.models.spec import ParamSpec

EXPONENTIAL_FLOOR = 1e-3
"""epsilon of the exponential loss scheduler, eps^(r / L): lambda falls to 0.001 at round L (the authors' code)."""


class AppleSettings(LocalStepsSettings):
    name: Literal["apple"] = "apple"
    lr: float = Field(0.01, gt=0, description="eta_1: the core model's learning rate (the authors' code: 0.01)")
    p_lr: float = Field(
        0.001,
        ge=0,
        description="eta_2: the DR vector's learning rate (the authors' code: 0.001); 0: p_i stays where it starts",
    )
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr", "p_lr")
    mu: float = Field(
        0.1, ge=0, description="mu: weight of the pull (mu / 2) ||p_i - p_0||^2 at lambda = 1 (the authors' code: 0.1)"
    )
    decay_rounds: int = Field(
        16,
        ge=1,
        description="L: the loss scheduler lambda(r) reaches 0 at round L (the authors' code: 0.1 of its 160 rounds)",
    )
    scheduler: Literal["cosine", "exponential"] = Field(
        "cosine",
        description="lambda(r) = (cos(pi r / L) + 1) / 2 (cosine: PFLlib, FLGo) or 0.001^(r / L) (exponential: the "
        "authors' code), 0 from round L",
    )
    momentum: float = Field(
        0.0, ge=0, lt=1, description="SGD momentum of theta_i and p_i, reset every round (the authors' code: 0.9)"
    )
    p_gradient: Literal["exact", "layer_mean"] = Field(
        "exact",
        description="the DR gradient: <g, theta_j> (exact, the chain rule) or PFLlib's mean over layers of the mean "
        "of g * theta_j (layer_mean)",
    )


@dataclass
class AppleBroadcast:
    models: Vector
    """[m, n]: every client's latest core model theta_j; a client receives the m - 1 rows of the others."""
    prior: Vector
    """[m]: p_0, the clients' weights alpha_j normalized (float64)."""
    round: int
    """The server's round r, 0 first: the loss scheduler's lambda(r). Not counted as traffic."""


@dataclass
class AppleUpload(Upload):
    """theta_i and alpha_i. It names no message field: the server reads it by client (`message`)."""

    core: Vector
    weight: float


@dataclass
class AppleClientState:
    p: Vector
    """p_i (float64, [m]); empty before the client's first step, when it starts at the broadcast's p_0."""
    personal: Vector
    """pm_i after the client's last step; empty before its first (it deploys the GM)."""


@dataclass
class AppleServerState:
    models: Vector
    """[m, n]: every client's latest core model (the initial model until it first uploads)."""
    weights: Vector
    """[m]: every client's weight alpha_j as last sent (1/m until it first uploads)."""
    round: int = 0


def loss_weight(round_index: int, decay_rounds: int, scheduler: str) -> float:
    """lambda(r): 1 at round 0, falling to 0 at round L (`decay_rounds`) along a half cosine, or geometrically to
    0.001 (`exponential`), and 0 from round L on."""
    if round_index >= decay_rounds:
        return 0.0
    if scheduler == "cosine":
        return (math.cos(math.pi * round_index / decay_rounds) + 1.0) / 2.0
    return EXPONENTIAL_FLOOR ** (round_index / decay_rounds)


def relationship_gradient(models: np.ndarray, grad: np.ndarray, params: ParamSpec, kind: str = "exact") -> Vector:
    """d f(sum_j p_j theta_j) / d p_j = <grad f(pm), theta_j> for each row theta_j of `models` (float64, [m]);
    `layer_mean`: PFLlib's estimate, the mean over the trainable tensors of each tensor's mean of grad * theta_j."""
    if kind == "exact":
        return np.asarray(models, np.float64) @ np.asarray(grad, np.float64)
    products = np.asarray(models, np.float64) * np.asarray(grad, np.float64)
    layers = [name for name in params.names if name not in params.statistics]
    return np.mean([products[:, params.slice(name)].mean(axis=1) for name in layers], axis=0)


def personalized(p: Vector, models: np.ndarray) -> Vector:
    """pm = sum_j p_j theta_j (float32)."""
    return (np.asarray(p, np.float64) @ np.asarray(models, np.float64)).astype(np.float32)


@ALGORITHMS.register()
class Apple(ServerReadsEachMessage[AppleSettings, AppleClientState, AppleServerState, AppleBroadcast, AppleUpload]):
    """Personalized models that are learned combinations of every client's core model."""

    name = "apple"
    Settings = AppleSettings
    Upload = AppleUpload

    def init_server(self, init_params: Vector, num_clients: int) -> AppleServerState:
        models = np.tile(np.asarray(init_params, np.float32), (num_clients, 1))
        return AppleServerState(models, np.full(num_clients, 1.0 / num_clients))

    def init_client(self, client: ClientInfo, init_params: Vector) -> AppleClientState:
        return AppleClientState(np.zeros(0), np.zeros(0, np.float32))

    def broadcast(self, server: AppleServerState) -> AppleBroadcast:
        return AppleBroadcast(server.models, server.weights / server.weights.sum(), server.round)

    def downlink_bytes(self, broadcast: AppleBroadcast) -> int:
        """The m - 1 other clients' core models and p_0, as float32."""
        m, n = broadcast.models.shape
        return 4 * ((m - 1) * n + m)

    def client_step(self, client: ClientInfo, state: AppleClientState, received: AppleBroadcast) -> ClientStep:
        """Steps on theta_i and p_i by the gradients of f_i at pm_i and the scheduled pull of p_i to p_0."""
        s = self.settings
        i = client.id
        models = np.array(received.models, np.float32)  # the client's copies; row i, its own, changes
        start = models[i].copy()
        prior = np.asarray(received.prior, np.float64)
        p = np.array(state.p if state.p.size else prior, np.float64)
        pull = loss_weight(received.round, s.decay_rounds, s.scheduler) * s.mu
        theta_velocity, p_velocity = np.zeros_like(start), np.zeros_like(p)
        steps = s.step_counts(client.num_train)
        losses = []
        for _ in range(int(steps)):
            result = yield from batch_gradients(BatchGradients(personalized(p, models)[None], s.batch_size))
            grad = result.grads[0]
            theta_grad = np.float32(p[i]) * grad  # d pm_i / d theta_i = p_ii
            p_grad = relationship_gradient(models, grad, self.params, s.p_gradient) + pull * (p - prior)
            theta_velocity = np.float32(s.momentum) * theta_velocity + theta_grad
            p_velocity = s.momentum * p_velocity + p_grad
            models[i] = models[i] - np.float32(s.lr) * theta_velocity
            p = p - s.p_lr * p_velocity
            losses.append(result.losses[0])
        core = models[i]
        metrics: dict[str, Number] = {
            "train_loss": mean_over_steps(losses, steps),
            "self_weight": float(p[i]),
            "weight_sum": float(p.sum()),
            "prior_gap": float(np.linalg.norm(p - prior)),
            "update_norm": float(np.linalg.norm(core - start)),
        }
        upload = AppleUpload(core.astype(np.float64), float(client.weight))
        return ClientUpdate(AppleClientState(p, personalized(p, models)), upload, metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """[theta_i, alpha_i]: the core model and the weight the server reads by client."""
        upload = update.upload
        return np.concatenate([np.asarray(upload.core, np.float64), [upload.weight]])

    def server_step_by_client(
        self, server: AppleServerState, total: AppleUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[AppleServerState, dict[str, float]]:
        """Store each uploaded theta_i and alpha_i; the next round's lambda(r)."""
        models, weights = server.models.copy(), server.weights.copy()
        for client, message in messages.items():
            models[client] = message[:-1]
            weights[client] = message[-1]
        state = AppleServerState(models, weights, server.round + 1)
        return state, server_metrics(self.global_model(state), self.global_model(server))

    def global_model(self, server: AppleServerState) -> Vector:
        """sum_j p_0j theta_j: the PM of a client whose p_i is p_0."""
        return personalized(server.weights / server.weights.sum(), server.models)

    def personalized_model(self, state: AppleClientState) -> Vector | None:
        return state.personal if state.personal.size else None
