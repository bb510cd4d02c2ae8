"""CFL: clustered federated learning, clusters split when their clients' updates disagree (Sattler, Mueller and
Samek, "Clustered Federated Learning: Model-Agnostic Distributed Multitask Optimization Under Privacy Constraints",
IEEE TNNLS 2021, arXiv:1910.01991, Algorithm 1).

The server keeps clusters of clients, one model theta_c each; all clients start in one cluster. A selected client i
of cluster c trains from theta_c for `epochs` epochs and sends its update dtheta_i = theta_i - theta_c. The server
moves each cluster by the mean of its clients' updates, theta_c <- theta_c + mean_{i in c} dtheta_i (unweighted,
as the authors' code `reduce_add_average`). Then, from round `warmup` on, a cluster whose mean update is small
while one of its clients' is large (a stationary point of the cluster's joint objective that is none of its
clients', Sec. III),

    || mean_{i in c} dtheta_i || < eps1   and   max_{i in c} || dtheta_i || > eps2,   with more than 2 of its clients,

is split in two by the cosine similarities of its clients' updates, complete linkage (the bipartition that
maximizes the smallest similarity across, Sec. III-B; the authors' AgglomerativeClustering on -similarity): the
clients selected this round go to the side their update falls in, the others stay with the first side, and both
sides start from theta_c. The server reads each client's update (`reads_messages`). A client receives its own
cluster's model (counted as one model down) and keeps it as its PM, the model its cluster gave it at its last step;
the GM is the mean of the cluster models weighted by their clients. Defaults: eps1 = 0.4, eps2 = 1.6 (the paper's
MNIST experiment), warmup = 20 rounds (the authors' code's `c_round > 20`). The clusters are logged
(`server/clusters`).
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


class CflSettings(SGDSettings):
    name: Literal["cfl"] = "cfl"
    eps1: float = Field(0.4, ge=0, description="a cluster splits only when its mean update's norm is below this")
    eps2: float = Field(1.6, ge=0, description="... and one of its clients' update norms is above this")
    warmup: int = Field(20, ge=0, description="rounds before any split (the authors' code: 20)")


@dataclass
class CflBroadcast:
    models: Vector
    """[clusters, n]: each cluster's model."""
    cluster_of: np.ndarray
    """[m] int: each client's cluster."""


@dataclass
class CflUpload(Upload):
    """dtheta_i = theta_i - theta_c. It names no message field: the server reads it by client (`message`), and
    Byzantine attacks and robust rules, which replace the mean of models, are refused."""

    update: Vector


@dataclass
class CflClientState:
    personal: Vector
    """The model its cluster gave it at its last step (the initial model before)."""


@dataclass
class CflServerState:
    models: Vector
    cluster_of: np.ndarray
    round: int = 0


@ALGORITHMS.register()
class Cfl(ServerReadsEachMessage[CflSettings, CflClientState, CflServerState, CflBroadcast, CflUpload]):
    """A model per cluster of clients; a cluster whose clients' updates disagree splits in two."""

    name = "cfl"
    Settings = CflSettings
    Upload = CflUpload

    def init_server(self, init_params: Vector, num_clients: int) -> CflServerState:
        return CflServerState(init_params[None].copy(), np.zeros(num_clients, np.int64))

    def init_client(self, client: ClientInfo, init_params: Vector) -> CflClientState:
        return CflClientState(init_params)  # shared and read-only until the first step replaces it

    def broadcast(self, server: CflServerState) -> CflBroadcast:
        return CflBroadcast(server.models, server.cluster_of)

    def downlink_bytes(self, broadcast: CflBroadcast) -> int:
        """One cluster's model: each client receives its own."""
        return payload_bytes(broadcast.models[0])

    def client_step(self, client: ClientInfo, state: CflClientState, received: CflBroadcast) -> ClientStep:
        start = received.models[received.cluster_of[client.id]]
        result = yield from train(self.settings.local_sgd(start))
        update = np.asarray(result.params, np.float64) - start
        metrics = {"train_loss": result.mean_loss, "update_norm": float(np.linalg.norm(update))}
        return ClientUpdate(CflClientState(np.array(start, np.float32)), CflUpload(update), metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """The client's update dtheta_i, which the server reads by client."""
        return update.upload.update

    def server_step_by_client(
        self, server: CflServerState, total: CflUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[CflServerState, dict[str, float]]:
        """Split the clusters that meet the criterion (from the round's updates), then move every cluster by the
        mean update of its selected clients, the two sides of a split each from the model they split from (the
        authors' order: split, then `reduce_add_average`)."""
        s = self.settings
        cluster_of = server.cluster_of.copy()
        bases = list(server.models)
        updates = {client: np.asarray(messages[client], np.float64) for client in sorted(messages)}
        for cluster in range(len(server.models)):
            members = [client for client in updates if server.cluster_of[client] == cluster]
            if server.round < s.warmup or len(members) <= 2:
                continue
            stacked = np.stack([updates[client] for client in members])
            quiet = np.linalg.norm(stacked.mean(axis=0)) < s.eps1
            if quiet and np.linalg.norm(stacked, axis=1).max() > s.eps2:
                for client, second in zip(members, bipartition(stacked), strict=True):
                    if second:
                        cluster_of[client] = len(bases)
                bases.append(server.models[cluster])
        models = np.stack(bases).astype(np.float32)
        for cluster in range(len(models)):
            moved = [updates[client] for client in updates if cluster_of[client] == cluster]
            if moved:
                models[cluster] = (bases[cluster] + np.mean(moved, axis=0)).astype(np.float32)
        global_model = self.weighted_mean(models, cluster_of)
        metrics = {
            **server_metrics(global_model, self.weighted_mean(server.models, server.cluster_of)),
            "clusters": float(len(models)),
            "splits": float(len(models) - len(server.models)),
        }
        return CflServerState(models, cluster_of, server.round + 1), metrics

    @staticmethod
    def weighted_mean(models: Vector, cluster_of: np.ndarray) -> Vector:
        """The cluster models' mean weighted by how many clients each holds."""
        counts = np.bincount(cluster_of, minlength=len(models)).astype(np.float64)
        return (counts @ models.astype(np.float64) / counts.sum()).astype(np.float32)

    def global_model(self, server: CflServerState) -> Vector:
        return self.weighted_mean(server.models, server.cluster_of)

    def personalized_model(self, state: CflClientState) -> Vector:
        return state.personal


def bipartition(updates: np.ndarray) -> np.ndarray:
    """Which of two sides each update falls in (bool, [k]): complete-linkage clustering of the updates by their
    cosine similarities (scikit-learn's AgglomerativeClustering on 1 - similarity, as the authors' code on -similarity:
    the same merges)."""
    from sklearn.cluster import AgglomerativeClustering

    unit = updates / np.maximum(np.linalg.norm(updates, axis=1, keepdims=True), 1e-12)
    distance = 1.0 - unit @ unit.T
    labels = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete").fit(distance).labels_
    return labels != labels[0]
