"""FedKD: a personal mentor and a shared mentee that teach each other, the mentee's updates sent as truncated SVDs
(Wu, Wu, Lyu, Huang and Xie, "Communication-efficient federated learning via knowledge distillation", Nature
Communications 13, 2032 (2022), arXiv:2108.13323; the equation numbers are the arXiv version's).

Every client keeps a mentor t_i (its personalized model, never sent); the server keeps the mentee s (the global
model). A selected client trains the received mentee and its mentor on its data, each on its task loss plus what it
distils from the other, both distillations weighted by the inverse of the two task losses (adaptive mutual
distillation):

    L_t = L_t^c + [KL(y_s || y_t) + MSE(H_t, H_s)] / (L_t^c + L_s^c)          (eq. 1-3, the mentor's)
    L_s = L_s^c + [KL(y_t || y_s) + MSE(H_t, H_s)] / (L_t^c + L_s^c)          (eq. 4-6, the mentee's)

with L^c the cross-entropies on the batch, y the predicted class probabilities and H the features z = f(x) (the
head's input). A model's loss treats the other model as a constant (the paper's two losses, each minimized by its
own model), so it is a loss term over one vector (`MutualDistillation`), and the two models take turns: with
`alternation: epoch` (default) each epoch is one pass of the mentee, distilling from the mentor as it stands, then
one pass of the mentor, distilling from the mentee just trained (two LocalSGD requests an epoch); with `step` they
alternate every mini-batch (two one-batch requests a step, epochs * ceil(n_i / B) steps), closer to PFLlib, which
trains both on the same batch at once. `weight` scales both distillations (1: the paper's; 0: each model learns its
task alone and the mentee is FedAvg), `hidden: false` drops the MSE, and `detach_weight` takes no gradient through
1/(L_t^c + L_s^c) (the paper and PFLlib differentiate it).

The mentee's update g_i = s_i - s is sent compressed (dynamic gradient approximation): every weight matrix of it
(linear weights as they are, conv weights matrixized as raysim.algorithms.prox.matrixize) is factored
g = U Sigma V^T (eq. 7) and only the top K singular triplets are sent, K the fewest whose energy
sum_{k <= K} sigma_k^2 / sum_k sigma_k^2 reaches T (eq. 8); 1-D tensors go dense. T rises over the rounds,

    T(t) = T_start + (T_end - T_start) min(t + 1, R) / R        (t = 0, 1, ... the round; eq. 9, the authors' code)

from the paper's 0.95 to 0.98 over R = `ramp_rounds` (the run's rounds in the paper: set it to `rounds`). The
server averages the reconstructed updates (uniformly, as the authors' code and PFLlib do; `aggregation: samples`
weights them by n_i), compresses the mean update at the same T and moves the mentee by it; the clients receive
that compressed global update (`compression: uplink` sends the mean update dense, `none` compresses nothing).

Differences from the paper: the mentor has the mentee's architecture (raysim trains one architecture per run; the
paper's mentor is larger, e.g. 12 against 4 transformer layers), so the hidden states are compared directly (the
paper's learned projection W^h maps the mentee's to the mentor's width; PFLlib learns one, W_h, even for equal
widths; the transformer's attention-heatmap MSE has no counterpart here); the partner model's dropout is off (a
constant target). PFLlib (serverkd.py, clientkd.py) also backpropagates each model's loss into the other (both
losses into both models), divides its KL by the number of classes (torch's KLDivLoss mean), clips gradients at norm
10, and compresses the mentee itself rather than its update; the authors' code compresses updates, as here.

An SVD is sent as U, Sigma and V (K (d1 + d2 + 1) numbers for a d1 x d2 matrix), or the truncated matrix dense where
that is smaller. Uplink: the compressed update and the client's weight; downlink: the compressed global update, what
a client that applies every round's update to its copy of the mentee needs (the paper's clients, all in every
round), and in round 0 the initial mentee dense. PM: the mentor once the client has trained (the GM before);
GM: the mentee.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.interface import (
    ALGORITHMS,
    NOT_SENT,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
    server_metrics,
)
from raysim.algorithms.prox import dematrixize, matrix_shape, matrixize
from raysim.algorithms.requests import LocalSGD, Number, Vector, batch_steps, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term, tempered_kl
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel


def adaptive_distillation(task: Number, partner_task: Number, distilled: Number, weight: float = 1.0) -> Number:
    """L^c + weight * distilled / (L^c + L^c_partner): a model's loss of eq. 3 / eq. 6, its distillation losses
    (KL and hidden MSE) `distilled` weighted by the inverse of both models' task losses (tensors or numbers)."""
    return task + weight * distilled / (task + partner_task)


@dataclass(frozen=True, eq=False)
class MutualDistillation(Term):
    """In place of f_i on a batch: one model's loss of the adaptive mutual distillation (eq. 1-3 for the mentor,
    4-6 for the mentee), CE(y_own) + weight [KL(p_partner || p_own) + MSE(z_own, z_partner)] / (CE_own +
    CE_partner), the partner a constant (its dropout off); `hidden` False drops the MSE, `detach_weight` True takes
    no gradient through the denominator."""

    partner: np.ndarray
    """The other model's flat parameters (the same architecture)."""
    weight: float = 1.0
    hidden: bool = True
    detach_weight: bool = False
    shared: ClassVar[tuple[str, ...]] = ("partner",)
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch.nn import functional

        if model.task != "classification":
            raise ValueError(f"FedKD distils class probabilities; model {model.name!r} is trained for {model.task}")
        partner = self.tensor("partner")
        with torch.no_grad():
            if self.hidden:
                partner_features, partner_logits = model.features(partner, x)
            else:
                partner_logits = model.forward(partner, x)
            partner_task = functional.cross_entropy(partner_logits, y)
        with model.dropout(seed):
            if self.hidden:
                features, logits = model.features(point, x)
            else:
                logits = model.forward(point, x)
        task = functional.cross_entropy(logits, y)
        if not self.weight:
            return task
        distilled = tempered_kl(logits, partner_logits, 1.0)
        if self.hidden:
            distilled = distilled + functional.mse_loss(features, partner_features)
        scale_task = task.detach() if self.detach_weight else task
        return task + self.weight * distilled / (scale_task + partner_task)


def energy_rank(singular_values: np.ndarray, energy: float) -> int:
    """K of eq. 8: the fewest leading singular values whose squares reach the fraction `energy` of the sum of all
    squares (all of them for energy 1; 0 for a zero matrix)."""
    squares = np.asarray(singular_values, np.float64) ** 2
    total = float(squares.sum())
    if total == 0.0:
        return 0
    fractions = np.cumsum(squares) / total
    return min(int(np.searchsorted(fractions, energy - 1e-12, side="left")) + 1, len(squares))


def svd_size(shape: tuple[int, ...], rank: int) -> int:
    """Numbers sent for a tensor of `shape` whose matrix keeps `rank` singular triplets: U, Sigma and V,
    rank (d1 + d2 + 1), or the truncated matrix dense where that is smaller; a 1-D tensor dense."""
    dense = int(np.prod(shape))
    if len(shape) < 2:
        return dense
    d1, d2 = matrix_shape(shape)
    return min(dense, rank * (d1 + d2 + 1))


@dataclass(frozen=True)
class Truncated:
    """A vector after the dynamic gradient approximation (eq. 7-8)."""

    params: np.ndarray
    """The reconstruction, float64: every matrix U_K Sigma_K V_K^T, 1-D tensors as they were."""
    numbers: int
    """Numbers sent (`svd_size` per tensor)."""
    ranks: dict[str, int]
    """K of every matrix tensor."""


def truncate(update: np.ndarray, spec: ParamSpec, energy: float) -> Truncated:
    """Every >= 2-D tensor of `update` replaced by its truncated SVD at energy threshold `energy` (eq. 7-8),
    computed in float64; 1-D tensors unchanged."""
    import torch

    source = np.asarray(update, np.float64)
    result = source.copy()
    numbers = 0
    ranks: dict[str, int] = {}
    for name, shape in zip(spec.names, spec.shapes, strict=True):
        where = spec.slice(name)
        if len(shape) < 2:
            numbers += int(np.prod(shape))
            continue
        matrix = matrixize(torch.from_numpy(source[where].reshape(shape)))
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        rank = energy_rank(s.numpy(), energy)
        kept = (u[:, :rank] * s[:rank]) @ vh[:rank, :]
        result[where] = dematrixize(kept, shape).reshape(-1).numpy()
        ranks[name] = rank
        numbers += svd_size(shape, rank)
    return Truncated(result, numbers, ranks)


class FedKdSettings(SGDSettings):
    name: Literal["fedkd"] = "fedkd"
    weight: float = Field(
        1.0,
        ge=0,
        description="scale of both adaptive distillations (KL and hidden MSE over the sum of the task losses; 1: the "
        "paper's; 0: mentor and mentee learn their task alone, the mentee is FedAvg)",
    )
    hidden: bool = Field(True, description="distil the hidden states (the features' MSE, eq. 2 and 5) as well")
    detach_weight: bool = Field(
        False,
        description="no gradient through 1 / (L_t^c + L_s^c) (false: the losses differentiated as written, the paper "
        "and PFLlib)",
    )
    alternation: Literal["epoch", "step"] = Field(
        "epoch",
        description="how mentee and mentor take turns, each distilling from the other as it stands: a pass each per "
        "epoch, or a mini-batch each per step (closer to PFLlib's joint steps; momentum restarts every step)",
    )
    mentee_lr: float | None = Field(
        None, gt=0, description="the mentee's SGD rate; None: lr (PFLlib: mentee_learning_rate)"
    )
    t_start: float = Field(0.95, gt=0, le=1, description="T_start: energy kept by the SVDs in the first round (eq. 9)")
    t_end: float = Field(0.98, gt=0, le=1, description="T_end: energy kept from round `ramp_rounds` on (eq. 9)")
    ramp_rounds: int = Field(
        100, ge=1, description="R: rounds over which T rises from t_start to t_end (the paper: all rounds, `rounds`)"
    )
    compression: Literal["both", "uplink", "none"] = Field(
        "both",
        description="SVD-truncate the clients' updates and the server's mean update (the paper), the clients' only, "
        "or nothing",
    )
    aggregation: Literal["uniform", "samples"] = Field(
        "uniform",
        description="weights of the clients' updates in the server's mean: equal (the authors' code, PFLlib) or n_i",
    )
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr", "mentee_lr")

    @model_validator(mode="after")
    def _one_pass_requests(self) -> FedKdSettings:
        if self.random_epochs:
            raise ValueError("algorithm.random_epochs: fedkd trains in turns of one pass or one batch; set it false")
        return self

    def energy(self, round_index: int) -> float:
        """T(t) of eq. 9 at round t (0-based), the authors' code's (t + 1) / R, held at T_end from round R - 1."""
        progress = min(round_index + 1, self.ramp_rounds) / self.ramp_rounds
        return self.t_start + (self.t_end - self.t_start) * progress


@dataclass
class FedKdClientState:
    mentor: Vector
    """t_i, the client's mentor (its PM once trained)."""
    trained: bool
    """Whether it has trained yet (before, the client deploys the GM)."""


@dataclass
class FedKdServerState:
    mentee: Vector
    """s, the global mentee (the GM)."""
    round: int
    """The round the next broadcast serves (its T)."""
    downlink: int
    """Numbers that the next broadcast sends: the last compressed global update (the initial mentee in round 0)."""


@dataclass
class FedKdBroadcast:
    mentee: Vector
    energy: float
    """T(t) of this round."""
    numbers: int
    """Numbers sent to each client (`downlink_bytes`)."""


@dataclass
class FedKdUpload(Upload):
    """a_i (s + g~_i) and a_i: the mentee the server rebuilds from the client's compressed update g~_i, weighted."""

    weighted: Vector
    weight: Number
    numbers: float = field(default=0.0, metadata=NOT_SENT)
    """Numbers the compressed update takes on the wire (`uplink_bytes`)."""

    message_field = "weighted"
    weight_field = "weight"


@ALGORITHMS.register()
class FedKd(Algorithm[FedKdSettings, FedKdClientState, FedKdServerState, FedKdBroadcast, FedKdUpload]):
    """Adaptive mutual distillation between a personal mentor and the shared mentee; SVD-truncated updates."""

    name = "fedkd"
    Settings = FedKdSettings
    Upload = FedKdUpload

    def init_server(self, init_params: Vector, num_clients: int) -> FedKdServerState:
        return FedKdServerState(init_params.copy(), 0, int(init_params.size))

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedKdClientState:
        return FedKdClientState(init_params.copy(), False)

    def broadcast(self, server: FedKdServerState) -> FedKdBroadcast:
        return FedKdBroadcast(server.mentee, self.settings.energy(server.round), server.downlink)

    def client_step(self, client: ClientInfo, state: FedKdClientState, received: FedKdBroadcast) -> ClientStep:
        s = self.settings
        mentee = np.array(received.mentee, np.float32)
        mentor = np.array(state.mentor, np.float32)
        if s.alternation == "epoch":
            turns, options = s.epochs, {}
        else:
            turns, options = int(batch_steps(client.num_train, s.batch_size, s.epochs)), {"random_batches": 1}
        mentee_losses: list[float] = []
        mentor_losses: list[float] = []
        for _ in range(turns):
            taught = yield from train(self.turn(mentee, mentor, s.mentee_lr or s.lr, options))
            mentee = np.asarray(taught.params, np.float32)
            mentee_losses.append(float(taught.mean_loss))
            taught = yield from train(self.turn(mentor, mentee, s.lr, options))
            mentor = np.asarray(taught.params, np.float32)
            mentor_losses.append(float(taught.mean_loss))
        update = mentee.astype(np.float64) - received.mentee
        if s.compression == "none":
            sent = Truncated(update, int(update.size), {})
        else:
            sent = truncate(update, self.params, received.energy)
        weight = np.float32(client.num_train if s.aggregation == "samples" else 1.0)
        upload = FedKdUpload(weight * (received.mentee + sent.params), weight, float(sent.numbers))
        metrics = {
            "train_loss": float(np.mean(mentee_losses)) if mentee_losses else float("nan"),
            "mentor_train_loss": float(np.mean(mentor_losses)) if mentor_losses else float("nan"),
            "uplink_fraction": sent.numbers / update.size,
            "energy": received.energy,
        }
        return ClientUpdate(FedKdClientState(mentor, True), upload, metrics)

    def turn(self, start: Vector, partner: Vector, lr: float, options: dict[str, int]) -> LocalSGD:
        """One model's turn: SGD from `start` on its mutual-distillation loss against `partner`, one pass (or one
        batch, with `random_batches`)."""
        s = self.settings
        term = MutualDistillation(partner, s.weight, s.hidden, s.detach_weight)
        return dataclasses.replace(s.local_sgd(start, 1, terms=(term,), **options), lr=lr)

    def server_step(
        self, server: FedKdServerState, total: FedKdUpload, num_selected: int
    ) -> tuple[FedKdServerState, dict[str, float]]:
        """s <- s + approx_T(mean_i g~_i): the mean of the rebuilt updates, truncated again for the downlink."""
        weight = float(np.asarray(total.weight))
        if weight <= 0:
            return FedKdServerState(server.mentee, server.round + 1, 0), server_metrics(server.mentee, server.mentee)
        mean = np.asarray(total.weighted, np.float64) / weight - server.mentee
        if self.settings.compression == "both":
            sent = truncate(mean, self.params, self.settings.energy(server.round))
        else:
            sent = Truncated(mean, int(mean.size), {})
        mentee = (server.mentee + sent.params).astype(np.float32)
        metrics = {**server_metrics(mentee, server.mentee), "downlink_fraction": sent.numbers / mean.size}
        return FedKdServerState(mentee, server.round + 1, sent.numbers), metrics

    def global_model(self, server: FedKdServerState) -> Vector:
        return server.mentee

    def personalized_model(self, state: FedKdClientState) -> Vector | None:
        """The mentor once the client has trained; the GM before."""
        return state.mentor if state.trained else None

    def uplink_bytes(self, upload: FedKdUpload) -> int:
        """The compressed update's numbers and the weight, as float32."""
        return 4 * (int(upload.numbers) + 1)

    def downlink_bytes(self, broadcast: FedKdBroadcast) -> int:
        """The compressed global update (the initial mentee in round 0), as float32."""
        return 4 * int(broadcast.numbers)
