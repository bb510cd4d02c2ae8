"""FedCAC: critical parameters shared only with clients whose critical parameters sit in the same places (Wu, Liu,
Niu, Zhu and Tang, "Bold but Cautious: Unlocking the Potential of Personalized Federated Learning through Cautiously
Aggressive Collaboration", ICCV 2023, arXiv:2309.11103; the authors' code is in their Fling library, and PFLlib
has a port).

A selected client i trains `epochs` epochs of SGD from its start v_i (below) to theta_i, then scores every parameter
by its sensitivity to the client's data, s = |theta_i * (theta_i - v_i)| (eq. 3: the first-order change of the
loss were the parameter zeroed, its gradient estimated by the local update), and marks the top `tau` share of each
parameter tensor as critical, the mask M_i. It sends theta_i (times its weight n_i, with n_i) and M_i. The server
reads every selected client's message [theta_i, M_i] (`reads_messages`) and

- the global model w = sum_i n_i theta_i / sum_i n_i over the selected clients (eq. 8, the authors' `fed_avg`;
  `aggregation: uniform` for equal weights), the GM;
- the overlap of two clients' critical sets, o_ij = 1 - ||M_i - M_j||_1 / (2 ||M_i||_1) (eq. 4-5: the share of
  i's critical parameters that are j's too, each set being a tau share), over the selected pairs i != j;
- the threshold xi_t = mean(o) + (t / beta) (max(o) - mean(o)) in round t = 1, 2, ... (eq. 6: it rises from the
  mean to the largest overlap in beta rounds, collaboration on critical parameters narrowing as the models
  specialize: once t > beta nobody collaborates, unless all overlaps are equal), and client i's collaborators
  C_i = {i} and {j : o_ij >= xi_t};
- client i's customized global model u_i = mean_{j in C_i} theta_j (eq. 7, unweighted as the authors' code).

Client i starts its next round from v_i = M_i * u_i + (1 - M_i) * w (eq. 9): its critical parameters from its
collaborators, the others from everyone. The server sends each client that model (one model down; the server holds
every client's latest u_i and M_i, so that a client not selected for a while starts from the u_i and M_i of its
last round and the latest w, as PFLlib's); a client that never trained starts from w. The PM is the client's locally
trained theta_i (Fling's `before_aggregation` score); `aggregated` scores v_i, the model it would start from now
(Fling's `after_aggregation`, PFLlib's score).

Special cases the tests check: tau = 0 (nothing critical) is FedAvg; tau = 1 with one client a round (no
collaborator) is local training from the client's first start; tau = 1 with every client selected is FedAvg with
equal weights (identical critical sets: every overlap is 1, every client collaborates with all).

Paper and authors' code: the mask takes exactly floor(tau n_l) parameters of each tensor, ties going to the lower
index (`selection: top_k`); `selection: authors` is the authors' rule, every parameter whose sensitivity reaches
the floor(tau n_l)-th largest (ties all in), and, when that value is below 1e-10, every parameter with a sensitivity
above 1e-20. The round counter t is the authors' (epoch + 1), 1 in the first round. BatchNorm's running statistics
(ParamSpec.statistics) are never critical: they come from w. The overlaps and collaborators are among the round's
selected clients (PFLlib's; the authors select every client). Defaults: tau = 0.5, beta = 170 (the authors' code
uses 0.5 and 100 for CIFAR-10, 0.4 and 170 for CIFAR-100). Each round logs the mean number of collaborators a
selected client has besides itself (`server/collaborators`), the mean overlap and the threshold. The messages are not
averaging messages, so Byzantine attacks and robust rules are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import upload_weight
from raysim.algorithms.interface import (
    ALGORITHMS,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerReadsEachMessage,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import Number, Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.models.spec import ParamSpec

Selection = Literal["top_k", "authors"]


class FedCacSettings(SGDSettings):
    name: Literal["fedcac"] = "fedcac"
    tau: float = Field(0.5, ge=0, le=1, description="the share of each parameter tensor marked critical (eq. 3)")
    beta: float = Field(
        170.0,
        gt=0,
        description="rounds over which the collaboration threshold rises from the mean to the largest overlap (eq. 6)",
    )
    selection: Selection = Field(
        "top_k",
        description="critical parameters: the floor(tau n) most sensitive of each tensor (top_k), or the authors' "
        "threshold rule (authors: ties all in; below 1e-10, every parameter above 1e-20)",
    )
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weights of the global model's average: n_i (the authors' fed_avg) or equal"
    )


@dataclass
class FedCacBroadcast:
    """What the server holds for every client's start (eq. 9); each client receives only its own start."""

    w: Vector
    """The global model (eq. 8)."""
    customized: np.ndarray
    """[m, n] float32: each client's customized global model u_i (eq. 7) of its latest round (0 before)."""
    critical: np.ndarray
    """[m, n] bool: each client's latest critical mask M_i (none before its first round)."""

    def start(self, client: int, w: Vector | None = None) -> Vector:
        """v_i = M_i * u_i + (1 - M_i) * w (eq. 9), with the given global model (default: the broadcast's)."""
        w = self.w if w is None else w
        return np.where(self.critical[client], self.customized[client], w).astype(np.float32)


@dataclass
class FedCacUpload(Upload):
    """n_i theta_i, n_i and the mask M_i (0/1). It names no message field: the server reads [theta_i, M_i] by client
    (`message`), and Byzantine attacks and robust rules are refused."""

    weighted: Vector
    weight: Number
    critical: Vector


@dataclass
class FedCacClientState:
    theta: Vector
    """The model of the client's latest local training (the initial model before): its PM."""
    client: int
    """The client's id, to find its customized model in the evaluation context (`extra_models`)."""


@dataclass
class FedCacServerState:
    w: Vector
    customized: np.ndarray
    critical: np.ndarray
    round: int = 0


@ALGORITHMS.register()
class FedCac(
    ServerReadsEachMessage[FedCacSettings, FedCacClientState, FedCacServerState, FedCacBroadcast, FedCacUpload]
):
    """Critical parameters averaged among collaborators with overlapping critical sets, the others among all."""

    name = "fedcac"
    Settings = FedCacSettings
    Upload = FedCacUpload

    def init_server(self, init_params: Vector, num_clients: int) -> FedCacServerState:
        size = init_params.size
        return FedCacServerState(
            init_params.astype(np.float32),
            np.zeros((num_clients, size), np.float32),
            np.zeros((num_clients, size), bool),
        )

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedCacClientState:
        return FedCacClientState(init_params, client.id)  # shared and read-only until the first step replaces it

    def broadcast(self, server: FedCacServerState) -> FedCacBroadcast:
        return FedCacBroadcast(server.w, server.customized, server.critical)

    def client_step(self, client: ClientInfo, state: FedCacClientState, received: FedCacBroadcast) -> ClientStep:
        """Local training from v_i, then the critical mask of the update (eq. 3)."""
        s = self.settings
        start = received.start(client.id)
        result = yield from train(s.local_sgd(start))
        theta = np.array(result.params, np.float32)
        critical = critical_mask(self.params, theta, start, s.tau, s.selection)
        weight = upload_weight(client.num_train, s.aggregation)
        upload = FedCacUpload(weight * theta, weight, critical.astype(np.float32))
        metrics = {
            "train_loss": result.mean_loss,
            "update_norm": float(np.linalg.norm(theta - start)),
            "critical_share": float(critical.mean()) if critical.size else 0.0,
        }
        return ClientUpdate(FedCacClientState(theta, client.id), upload, metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """[theta_i, M_i]: the model and the mask the server reads by client."""
        return np.concatenate([update.state.theta, update.upload.critical]).astype(np.float32)

    def server_step_by_client(
        self, server: FedCacServerState, total: FedCacUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[FedCacServerState, dict[str, float]]:
        """The global model (eq. 8), then each selected client's collaborators (eq. 4-6) and customized model
        (eq. 7)."""
        size = server.w.size
        w = (np.asarray(total.weighted, np.float64) / total.weight).astype(np.float32)
        clients = sorted(messages)
        rows = np.stack([np.asarray(messages[client], np.float32) for client in clients])
        models, masks = rows[:, :size], rows[:, size:] > 0.5
        overlap = overlaps(masks)
        threshold = collaboration_threshold(overlap, server.round + 1, self.settings.beta)
        together = (overlap >= threshold) | np.eye(len(clients), dtype=bool)
        customized, critical = server.customized.copy(), server.critical.copy()
        for row, client in enumerate(clients):
            customized[client] = models[together[row]].astype(np.float64).mean(axis=0)
            critical[client] = masks[row]
        metrics = {**server_metrics(w, server.w), "collaborators": float(together.sum(axis=1).mean() - 1)}
        if len(clients) > 1:
            off_diagonal = overlap[~np.eye(len(clients), dtype=bool)]
            metrics |= {"overlap": float(off_diagonal.mean()), "overlap_threshold": float(threshold)}
        return FedCacServerState(w, customized, critical, server.round + 1), metrics

    def global_model(self, server: FedCacServerState) -> Vector:
        return server.w

    def personalized_model(self, state: FedCacClientState) -> Vector:
        return state.theta

    def evaluation_context(self, server: FedCacServerState) -> FedCacBroadcast:
        """Every client's customized model and mask, for `aggregated` (`extra_models`)."""
        return self.broadcast(server)

    def extra_models(
        self, state: FedCacClientState, global_params: Vector, context: FedCacBroadcast | None = None
    ) -> dict[str, Vector]:
        """`aggregated`: v_i with the current global model, the model the client would start its next round from."""
        if context is None or state.client >= len(context.critical):  # a held-out client has none
            return {}
        return {"aggregated": context.start(state.client, global_params)}

    def uplink_bytes(self, upload: FedCacUpload) -> int:
        """theta_i and n_i as float32, and the mask M_i as one bit a parameter."""
        size = int(np.size(upload.weighted))
        return 4 * (size + 1) + -(-size // 8)

    def downlink_bytes(self, broadcast: FedCacBroadcast) -> int:
        """One model: the client's start v_i, which the server mixes from u_i, M_i and w (eq. 9)."""
        return 4 * int(broadcast.w.size)


def critical_mask(
    params: ParamSpec, new: Vector, old: Vector, tau: float, selection: Selection = "top_k"
) -> np.ndarray:
    """M (bool, parameter-sized): in each parameter tensor, the tau share with the largest sensitivity
    |new * (new - old)| (eq. 3); never a running statistic."""
    theta = np.asarray(new, np.float64)
    sensitivity = np.abs(theta * (theta - np.asarray(old, np.float64)))
    mask = np.zeros(theta.size, bool)
    for name in params.names:
        if name not in params.statistics:
            part = params.slice(name)
            mask[part] = layer_critical(sensitivity[part], tau, selection)
    return mask


def layer_critical(sensitivity: np.ndarray, tau: float, selection: Selection = "top_k") -> np.ndarray:
    """One tensor's critical parameters: its floor(tau n) most sensitive (`top_k`: ties to the lower index), or the
    authors' rule (`authors`: all that reach the floor(tau n)-th largest value; if that value is below 1e-10, all
    above 1e-20 instead, and all if none is)."""
    count = int(tau * sensitivity.size)
    chosen = np.zeros(sensitivity.size, bool)
    if selection == "top_k":
        chosen[np.argsort(-sensitivity, kind="stable")[:count]] = True
        return chosen
    if count == 0:
        return chosen
    threshold = np.partition(sensitivity, sensitivity.size - count)[sensitivity.size - count]
    if threshold <= 1e-10:
        above = sensitivity[sensitivity > 1e-20]
        if above.size:
            threshold = above.min()
    return sensitivity >= threshold


def overlaps(masks: np.ndarray) -> np.ndarray:
    """o_ij = 1 - ||M_i - M_j||_1 / (2 ||M_i||_1) for the rows of `masks` ([k, n] bool; eq. 4-5): the share of i's
    critical parameters that j's are too, when both sets have the same size. A client without a critical parameter
    overlaps fully with another without one and not at all with the others."""
    counts = masks.sum(axis=1).astype(np.float64)
    common = masks.astype(np.float64) @ masks.T.astype(np.float64)
    differ = counts[:, None] + counts[None, :] - 2.0 * common
    with np.errstate(divide="ignore", invalid="ignore"):
        overlap = 1.0 - differ / (2.0 * counts[:, None])
    return np.where(counts[:, None] > 0, overlap, (differ == 0).astype(np.float64))


def collaboration_threshold(overlap: np.ndarray, t: int, beta: float) -> float:
    """xi_t = mean + (t / beta)(max - mean) of the overlaps between distinct clients (eq. 6); infinite (nobody
    collaborates) for fewer than two clients."""
    if len(overlap) < 2:
        return float("inf")
    pairs = overlap[~np.eye(len(overlap), dtype=bool)]
    mean = float(pairs.mean())
    return mean + t / beta * (float(pairs.max()) - mean)
