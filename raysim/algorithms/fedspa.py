"""FedSpa: a personalized sparse mask per client, found by dynamic sparse training (Huang et al., 2022).

Huang, Liu, Shen, He, Lin, Tao, "Achieving Personalized Federated Learning with Sparse Local Models",
arXiv:2201.11380; FedSLR's baseline (FedSLR, App. B.2), counted with 50% masks: half the dense model each way
(FedSLR, Table 2).

Each client k keeps a binary mask m_k over the model; its sparse local model is w ⊙ m_k. A selected client, given
the dense global model w_t and round t, runs (Huang et al., Algorithm 1)

    x_k   <- `epochs` epochs of SGD from w_t ⊙ m_k moving only the coordinates of m_k     (sparse local training)
    m_k   <- Next_Mask(m_k, x_k, alpha_t):                                             (mask search)
             in each sparse tensor, drop the alpha_t * (its active count) active weights of smallest |x_k|, then
             activate as many inactive ones (the dropped ones included) of largest |grad f_k(x_k)|
    alpha_t = prune_rate/2 (1 + cos(pi min(t, T) / T))                                 (cosine annealing, T =
                                                                                        anneal_rounds)

and uploads its sparse update Delta_k = x_k - w_t ⊙ m_k (nonzero only on the mask it trained). The server adds
the mean update over the selected clients, w_{t+1} = w_t + (1/|S|) sum_{k in S} Delta_k (`aggregation: selected`,
the averaging of the sparse updates of Algorithm 1), or per coordinate over the clients whose masks hold it
(`aggregation: holders`: w_{t+1,j} = mean of x_{k,j} over those k; coordinates no selected mask holds keep w_t).

Each sparse tensor (the >= 2-D weights of convolutions and linear layers) keeps round(density * size) active
entries at every round (layer-wise uniform density); 1-D parameters (biases, norms) are dense, as in RigL. The
initial masks are drawn at random per client (exactly that count per tensor), from a stream keyed by the client and
the initial model, so that they are the same whatever the hosts. The regrowth uses the full-batch gradient of f_k at
x_k over the client's training split (a FullGradient request; [I] the paper takes the stochastic gradient of the
dense model on the local data: the full batch removes that draw). Downlink and uplink carry the masked coordinates
only (the mask's positions are not counted, as FedSLR's Table 2 counts FedSpa at half the dense cost). The GM is the
dense w; a client's PM is the latest w ⊙ m_k. With density 1 the masks are full and never change, and FedSpa is
FedAvg with equal weights. The step is written over rows, so it stacks (vectorized hosts).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import FullGradient, Number, Vector, gradient, train
from raysim.algorithms.settings import SGDSettings
from raysim.models.spec import ParamSpec


class FedSpaSettings(SGDSettings):
    name: Literal["fedspa"] = "fedspa"
    density: float = Field(
        0.5, gt=0, le=1, description="fraction of each sparse tensor a client's mask keeps (FedSLR: 50% masks)"
    )
    prune_rate: float = Field(
        0.5, ge=0, le=1, description="alpha_0: fraction of a tensor's active weights dropped and regrown at round 0"
    )
    anneal_rounds: int = Field(
        1000, ge=1, description="T of the cosine schedule alpha_t = alpha_0/2 (1 + cos(pi t/T)); 0 from round T on"
    )
    aggregation: Literal["selected", "holders"] = Field(
        "selected",
        description="w += the sum of the sparse updates over the selected clients divided by their number "
        "(Algorithm 1), or by the number of selected masks holding each coordinate",
    )


@dataclass
class FedSpaClientState:
    mask: np.ndarray
    """m_k, boolean, parameter-sized: the client's active coordinates."""


@dataclass
class FedSpaServerState:
    w: Vector
    """The dense global model."""
    round: int


@dataclass(frozen=True, eq=False)
class FedSpaBroadcast:
    w: Vector
    """w_t; a client receives only w_t ⊙ m_k (`downlink_bytes`)."""
    round: int
    """t, for the prune rate's schedule."""


@dataclass
class FedSpaUpload(Upload):
    change: Vector
    """Delta_k = x_k - w_t ⊙ m_k, zero outside the mask it trained on (float64)."""
    holders: Vector
    """m_k as 0/1 (float64): summed, the number of selected masks holding each coordinate."""
    count: Number = 1.0
    """1 per client (one per row of a chunk): summed, |S|."""


@ALGORITHMS.register()
class FedSpa(Algorithm[FedSpaSettings, FedSpaClientState, FedSpaServerState, FedSpaBroadcast, FedSpaUpload]):
    name = "fedspa"
    Settings = FedSpaSettings
    Upload = FedSpaUpload
    stacks = True
    scales_loss = True

    def __init__(self, settings: FedSpaSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.sparse = [params.slice(n) for n, shape in zip(params.names, params.shapes, strict=True) if len(shape) > 1]
        """The tensors the masks thin out: weights of >= 2 dimensions."""
        self.dense = np.ones(params.size, dtype=bool)
        for where in self.sparse:
            self.dense[where] = False
        self.active_count = int(self.dense.sum()) + sum(self.kept(where) for where in self.sparse)
        """Active coordinates of every mask (the same for all clients at every round)."""

    def kept(self, where: slice) -> int:
        """Active entries of a sparse tensor: round(density * size), at least 1."""
        return max(1, round(self.settings.density * (where.stop - where.start)))

    def prune_rate(self, round_index: int) -> float:
        """alpha_t = alpha_0/2 (1 + cos(pi min(t, T)/T)) (cosine annealing of the mask search)."""
        s = self.settings
        return s.prune_rate / 2 * (1 + math.cos(math.pi * min(round_index, s.anneal_rounds) / s.anneal_rounds))

    def init_server(self, init_params: Vector, num_clients: int) -> FedSpaServerState:
        return FedSpaServerState(init_params.copy(), 0)

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedSpaClientState:
        """A random mask with exactly `kept` entries in each sparse tensor, keyed by the client and the initial
        model (the same on any host)."""
        rng = np.random.default_rng([zlib.crc32(np.ascontiguousarray(init_params).tobytes()), client.id])
        mask = self.dense.copy()
        for where in self.sparse:
            chosen = rng.choice(where.stop - where.start, self.kept(where), replace=False)
            mask[where.start + chosen] = True
        return FedSpaClientState(mask)

    def broadcast(self, server: FedSpaServerState) -> FedSpaBroadcast:
        return FedSpaBroadcast(server.w, server.round)

    def next_mask(self, mask: np.ndarray, weights: Vector, grad: Vector, rate: float) -> tuple[np.ndarray, int]:
        """Next_Mask: per sparse tensor, drop the floor(rate * active) active entries of smallest |weights| and
        activate as many inactive ones of largest |grad| (one mask, or a chunk's rows); the new mask and the
        number of entries swapped per mask."""
        new = mask.copy()
        swapped = 0
        for where in self.sparse:
            active = self.kept(where)
            count = int(rate * active)
            if count == 0 or active == where.stop - where.start:  # a full tensor would regrow what it drops
                continue
            part = new[..., where]
            magnitude = np.where(part, np.abs(weights[..., where]), np.inf)
            dropped = np.argpartition(magnitude, count - 1, axis=-1)[..., :count]
            np.put_along_axis(part, dropped, False, axis=-1)
            score = np.where(part, -np.inf, np.abs(grad[..., where]))
            grown = np.argpartition(-score, count - 1, axis=-1)[..., :count]
            np.put_along_axis(part, grown, True, axis=-1)
            new[..., where] = part
            swapped += count
        return new, swapped

    def client_step(
        self, client: ClientInfo | ClientChunk, state: FedSpaClientState, broadcast: FedSpaBroadcast
    ) -> ClientStep:
        s = self.settings
        start = np.where(state.mask, broadcast.w, np.float32(0.0)).astype(np.float32)  # w_t ⊙ m_k
        result = yield from train(s.scaled(s.local_sgd(start, mask=state.mask), client.num_clients))
        trained = np.asarray(result.params, np.float32)
        rate = self.prune_rate(broadcast.round)
        grad = yield from gradient(FullGradient(trained))
        mask, swapped = self.next_mask(state.mask, trained, np.asarray(grad.grad, np.float32), rate)
        change = trained.astype(np.float64) - start
        metrics = {
            "train_loss": result.mean_loss,
            "prune_rate": rate,
            "mask_swapped": swapped / self.active_count,
            "update_norm": np.linalg.norm(change, axis=-1),
        }
        holders = state.mask.astype(np.float64)
        count: Number = np.ones(holders.shape[:-1]) if holders.ndim > 1 else 1.0
        return ClientUpdate(FedSpaClientState(mask), FedSpaUpload(change, holders, count), metrics)

    def server_step(self, server: FedSpaServerState, total: FedSpaUpload, num_selected: int):
        change = np.asarray(total.change, np.float64)
        if self.settings.aggregation == "holders":
            step = change / np.maximum(np.asarray(total.holders, np.float64), 1.0)
        else:
            step = change / float(total.count)
        w = (server.w + step).astype(np.float32)
        return FedSpaServerState(w, server.round + 1), server_metrics(w, server.w)

    def uplink_bytes(self, upload: FedSpaUpload) -> int:
        """The sparse update's values on the mask (float32)."""
        return 4 * self.active_count

    def downlink_bytes(self, broadcast: FedSpaBroadcast) -> int:
        """w_t ⊙ m_k on the mask, and the round (float32)."""
        return 4 * (self.active_count + 1)

    def global_model(self, server: FedSpaServerState) -> Vector:
        return server.w

    def evaluated_model(self, state: FedSpaClientState, global_params: Vector) -> Vector:
        """The client's sparse model w ⊙ m_k with the latest global model."""
        return np.where(state.mask, global_params, np.float32(0.0)).astype(np.float32)
