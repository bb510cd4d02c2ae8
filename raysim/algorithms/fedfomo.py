"""FedFomo: each client combines the other clients' models it benefits from, weighted by a first-order estimate of
how far each one lowers its own validation loss (Zhang, Sapra, Fidler, Yeung and Alvarez, "Personalized Federated
Learning with First Order Model Optimization", ICLR 2021, arXiv:2012.08565, Sec. 3 and Algorithm 1).

Every client i keeps its personalized model theta_i. The server keeps every client's latest model theta_n and an
affinity matrix P (client-to-client weights, zero at the start). A selected client receives M other clients' models
(`num_models`, the paper's 5; all available ones when fewer), those of highest affinity P[i, :], each slot taken
instead uniformly from the rest with probability eps_t = max(0, epsilon - t epsilon_decay) (epsilon-greedy, the
authors' code's 0.3 and 0.05 per round; epsilon 0 is PFLlib's top-M); ties break at random. The server draws the
choice from a stream keyed by the initial model and the round, so every host sees the same. The client evaluates its
loss L_i on its `split` (the paper's validation split, partition.val_fraction > 0, 0.2 in PFLlib and FL-bench;
`train` runs without one) at theta_i and at each theta_n, and weighs them (eqs. 5-6)

    w_n = max(0, (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||_2),   w_n <- w_n / sum_n w_n  (if any > 0)

then steps theta_i <- theta_i + sum_n w_n (theta_n - theta_i) (eq. 4; with no positive weight it stays), trains it
locally (`epochs` of SGD) and uploads theta_i, its weights and n_i; the server stores theta_i and adds the weights to
its row, P[i, n] += w_n (Algorithm 1). As the weights sum to 1, eq. 4 is the weighted average sum_n w_n theta_n, so
the libraries' weighted average is the same step: FL-bench's, over the received models and the client's own (whose
weight is 0), and PFLlib's (with `baseline: start`, below).

Switches for the libraries' choices: `affinity: raw` adds the signed weights before clipping and normalizing
(PFLlib, FL-bench); `candidates: last_round` offers only last round's uploaders (the authors' code, FL-bench)
instead of every client that has uploaded; `baseline: start` compares with the model the client's last local
training started from, its trained theta_i then one more candidate whose weight lands on P[i, i] (the authors'
code's default `first_model`, PFLlib's `old_model`). The norm is L2 (PFLlib, FL-bench; the authors' code defaults
to L1). With no candidate (round 0, or num_models 0) FedFomo is local training.

Each loss is a FullGradient request over the split (its gradient unused). The broadcast carries the server's whole
table of models, of which a client reads its M: it receives min(M, candidates) models (the downlink counts the most
any client receives) and sends its model, one weight per model it weighed, and n_i. The server reads each client's
message (`reads_messages`); attacks and robust rules are refused. The GM is the mean of the uploaded latest models
weighted by n_i (the initial model before any upload); the PM is theta_i.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    NOT_SENT,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerContext,
    ServerReadsEachMessage,
    Upload,
    payload_bytes,
    server_metrics,
)
from raysim.algorithms.requests import FullGradient, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.errors import ConfigError
from raysim.examples import ExampleContext, Fragment


class FedFomoSettings(SGDSettings):
    name: Literal["fedfomo"] = "fedfomo"
    num_models: int = Field(
        5, ge=0, description="M: other clients' models a selected client receives (the paper's 5; all when fewer)"
    )
    epsilon: float = Field(
        0.3, ge=0, le=1, description="epsilon-greedy: chance a slot takes a random candidate (authors' code: 0.3)"
    )
    epsilon_decay: float = Field(
        0.05, ge=0, description="epsilon falls by this each round, eps_t = max(0, epsilon - t decay) (authors': 0.05)"
    )
    split: Literal["val", "train"] = Field(
        "val",
        description="the client's split its loss L_i is measured on: val (paper; needs partition.val_fraction > 0) "
        "or train",
    )
    candidates: Literal["uploaded", "last_round"] = Field(
        "uploaded",
        description="models a client may receive: every client's that uploaded one, or last round's uploaders' "
        "(the authors' code, FL-bench)",
    )
    baseline: Literal["trained", "start"] = Field(
        "trained",
        description="the model the losses are compared with: theta_i, the trained one (paper), or the one its last "
        "training started from, the trained one then a candidate too (the authors' code, PFLlib)",
    )
    affinity: Literal["weights", "raw"] = Field(
        "weights",
        description="what P[i, n] accumulates: the clipped, normalized w_n of eq. 4 (paper) or the signed w_n before "
        "clipping (PFLlib, FL-bench)",
    )


@dataclass
class FedFomoBroadcast:
    models: Vector
    """[m, n]: every client's latest model as the server holds it."""
    chosen: np.ndarray
    """[m, M] int: the clients whose models each client receives, -1 past its count."""


@dataclass
class FedFomoUpload(Upload):
    """theta_i, its n_i, and its weights. It names no message field: the server reads it by client (`message`), and
    Byzantine attacks and robust rules, which replace the mean of models, are refused."""

    model: Vector
    samples: float
    weights: Vector = field(metadata=NOT_SENT)
    """[m]: w_n of each model it weighed (the received ones, its own too with baseline start), 0 elsewhere; on the
    wire one number per weighed model (`weighed`)."""
    weighed: float = field(metadata=NOT_SENT)
    """How many models the client weighed (and weights it sends)."""


@dataclass
class FedFomoClientState:
    personal: Vector
    """theta_i: the model after its last local training (the initial model before)."""
    start: Vector
    """baseline start: the model its last local training started from (else `personal` itself)."""


@dataclass
class FedFomoServerState:
    models: Vector
    """[m, n]: each client's latest uploaded model (the initial model before its first upload)."""
    affinity: np.ndarray
    """P [m, m] float64: P[i, n], the sum of the weights client i gave client n's model."""
    samples: np.ndarray
    """[m] float64: each client's n_i (0 before its first upload)."""
    uploaded: np.ndarray
    """[m] bool: the server holds a model the client uploaded."""
    last_round: np.ndarray
    """[m] bool: the client uploaded in the last round."""
    seed: int
    """Keys the epsilon-greedy draws (with the round)."""
    round: int = 0


@ALGORITHMS.register()
class FedFomo(
    ServerReadsEachMessage[FedFomoSettings, FedFomoClientState, FedFomoServerState, FedFomoBroadcast, FedFomoUpload]
):
    """Personalized models updated by first-order weighted combinations of other clients' models (eqs. 4-6)."""

    name = "fedfomo"
    Settings = FedFomoSettings
    Upload = FedFomoUpload

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """FedFomo on the training split: an example runs whatever the partition's validation share."""
        return {"algorithm": {"name": cls.name, "split": "train"}}

    def server_data(self, context: ServerContext) -> None:
        """No server data; refuse, before any work, a validation split the partition does not make."""
        if self.settings.split == "val" and context.val_fraction == 0 and context.partition != "file":
            raise ConfigError(
                "algorithm.split=val: FedFomo weighs the received models by their loss on each client's validation "
                "split, and partition.val_fraction is 0; set partition.val_fraction (e.g. 0.2, as PFLlib and "
                "FL-bench) or algorithm.split: train"
            )
        return None

    def init_server(self, init_params: Vector, num_clients: int) -> FedFomoServerState:
        return FedFomoServerState(
            models=np.tile(init_params.astype(np.float32), (num_clients, 1)),
            affinity=np.zeros((num_clients, num_clients)),
            samples=np.zeros(num_clients),
            uploaded=np.zeros(num_clients, bool),
            last_round=np.zeros(num_clients, bool),
            seed=zlib.crc32(np.ascontiguousarray(init_params).tobytes()),
        )

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedFomoClientState:
        return FedFomoClientState(init_params, init_params)  # shared and read-only until a step replaces them

    def broadcast(self, server: FedFomoServerState) -> FedFomoBroadcast:
        return FedFomoBroadcast(server.models, self.choose(server))

    def choose(self, server: FedFomoServerState) -> np.ndarray:
        """The M clients whose models each client receives: the candidates in decreasing affinity P[i, :] (ties at
        random), each slot taking a uniformly random remaining one with probability eps_t instead (Sec. 3.3)."""
        s = self.settings
        m = len(server.models)
        chosen = np.full((m, s.num_models), -1, np.int64)
        available = server.last_round if s.candidates == "last_round" else server.uploaded
        epsilon = max(0.0, s.epsilon - server.round * s.epsilon_decay)
        rng = np.random.default_rng([server.seed, server.round])
        for i in range(m):
            pool = np.flatnonzero(available & (np.arange(m) != i))
            count = min(s.num_models, len(pool))
            if count == 0:
                continue
            ranked = list(pool[np.lexsort((rng.random(len(pool)), -server.affinity[i, pool]))])
            explore = rng.random(count) < epsilon
            for slot in range(count):
                chosen[i, slot] = ranked.pop(int(rng.integers(len(ranked))) if explore[slot] else 0)
        return chosen

    def downlink_bytes(self, broadcast: FedFomoBroadcast) -> int:
        """The M models a client receives (the most any client receives this round)."""
        most = int((broadcast.chosen >= 0).sum(axis=1).max(initial=0))
        return most * payload_bytes(broadcast.models[0])

    def uplink_bytes(self, upload: FedFomoUpload) -> int:
        """theta_i and n_i, and one weight per weighed model."""
        return payload_bytes(upload) + 4 * int(upload.weighed)

    def client_step(self, client: ClientInfo, state: FedFomoClientState, received: FedFomoBroadcast) -> ClientStep:
        s = self.settings
        own = state.personal
        ids = received.chosen[client.id]
        ids = ids[ids >= 0]
        models = received.models[ids]
        base = own
        if s.baseline == "start" and len(ids):  # the code's: its own trained model is a candidate too
            base, ids, models = state.start, np.concatenate([[client.id], ids]), np.concatenate([own[None], models])
        raw = np.zeros(len(ids))
        base_loss = float("nan")
        if len(ids):
            base_loss = (yield from gradient(FullGradient(base, split=s.split))).loss
            for slot, model in enumerate(models):
                loss = (yield from gradient(FullGradient(model, split=s.split))).loss
                distance = float(np.linalg.norm(model.astype(np.float64) - base))
                raw[slot] = (base_loss - loss) / distance if distance > 0 else 0.0  # eq. 6
        weights = fomo_weights(raw)
        start = fomo_step(own, models, weights)
        result = yield from train(s.local_sgd(start))
        row = np.zeros(client.num_clients)
        row[ids] = raw if s.affinity == "raw" else weights
        upload = FedFomoUpload(np.asarray(result.params, np.float32), float(client.num_train), row, float(len(ids)))
        metrics = {
            "train_loss": result.mean_loss,
            "base_loss": base_loss,
            "weighed_models": float(len(ids)),
            "positive_weights": float(np.count_nonzero(weights)),
            "fomo_step": float(np.linalg.norm(start.astype(np.float64) - own)),
        }
        kept = start if s.baseline == "start" else upload.model
        return ClientUpdate(FedFomoClientState(upload.model, kept), upload, metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """[theta_i, the weights row (m), n_i], which the server reads by client."""
        upload = update.upload
        return np.concatenate([upload.model, upload.weights, [upload.samples]])

    def server_step_by_client(
        self, server: FedFomoServerState, total: FedFomoUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[FedFomoServerState, dict[str, float]]:
        """Store each client's model and n_i and add its weights to its row of P (Algorithm 1)."""
        m, n = server.models.shape
        models, affinity = server.models.copy(), server.affinity.copy()
        samples, uploaded = server.samples.copy(), server.uploaded.copy()
        last_round = np.zeros(m, bool)
        for client, message in messages.items():
            message = np.asarray(message)
            models[client] = message[:n]
            affinity[client] += message[n : n + m]
            samples[client] = message[n + m]
            uploaded[client] = last_round[client] = True
        new = FedFomoServerState(models, affinity, samples, uploaded, last_round, server.seed, server.round + 1)
        metrics = {
            **server_metrics(self.global_model(new), self.global_model(server)),
            "uploaded_clients": float(uploaded.sum()),
        }
        return new, metrics

    def global_model(self, server: FedFomoServerState) -> Vector:
        """The uploaded latest models' mean weighted by n_i (the initial model before any upload)."""
        if not server.samples.sum() > 0:
            return server.models[0]
        mean = server.samples @ server.models.astype(np.float64) / server.samples.sum()
        return mean.astype(np.float32)

    def personalized_model(self, state: FedFomoClientState) -> Vector:
        return state.personal


def fomo_weights(raw: np.ndarray) -> np.ndarray:
    """Eq. 4's weights from eq. 6's: the positive ones normalized to sum to 1, all 0 when none is positive."""
    positive = np.maximum(raw, 0.0)
    total = positive.sum()
    return positive / total if total > 0 else positive


def fomo_step(own: Vector, models: Vector, weights: np.ndarray) -> Vector:
    """theta_i + sum_n w_n (theta_n - theta_i) (eq. 4), float32; theta_i itself when every weight is 0."""
    if not weights.any():
        return own
    own64 = own.astype(np.float64)
    return (own64 + weights @ (models.astype(np.float64) - own64)).astype(np.float32)
