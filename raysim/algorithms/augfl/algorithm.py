"""AugFL: inexact-ADMM federated meta-learning with a server-side pretrained-model regularizer (AugFL, eqs. (7)-(13)).

Client i, given the meta-model theta^t, with full-batch gradients on its support set (`support_split`)
and query set (`query_split`):

    phi_i   = theta - alpha grad L_i(theta, D^s)                                          (7)
    r_i     = grad L_i(phi_i, D^q)
    g_i     = [grad L_i(theta + delta r_i, D^s) - grad L_i(theta - delta r_i, D^s)] / (2 delta)   (10)
    theta_i = theta - (y_i + w_i (r_i - alpha g_i)) / rho                                 (11)
    y_i     = y_i + rho (theta_i - theta)                                                 (12)

with delta = 1/(10k + 100) at the client's k-th participation (k = 1, 2, ...). The server keeps the sum
over ALL clients of y_i + rho theta_i (unselected clients count with their last values: an
extension, AugFL's analysis and experiments have full participation) and sets theta^{t+1} = (sum_i (y_i + rho theta_i) -
lambda grad R_h(theta^t, theta_p)) / (m rho)   (13).

R_h is `regularizer`: `crd` (the paper: contrastive representation distillation from a larger
pretrained model, the teacher, `transfer.mode` paper or the authors' code; raysim.algorithms.augfl.crd), `l2` =
||theta - theta_p||^2 (the theory's same-architecture case) or `none` (AugFL without the pretrained model).

The teacher theta_p and the transfer set D_s come from the two pools the `meta` partition keeps back from every
client (AugFL, Sec. VI): `server_data` reads theta_p from the weights file `teacher_weights` that `raysim pretrain`
wrote (checksum, model and classes verified), or trains it on the first pool by asking the runtime for a `TrainModel`
request (the authors' recipe of `teacher_*`; raysim.algorithms.augfl.teacher) unless it is cached, and returns it
with D_s, the second pool, as `AugFlServerData`; the
runtime hands that to `setup_server` on the coordinator only, never to a client host.

Held-out target clients (`clients.heldout`, 0.2 in the paper) are scored after `adapt`: one step from the
current theta on their support set (AugFL, Sec. VI).

`start: own` is the authors' round 0: nothing is broadcast, and client i runs eqs. 7-12 from its own initialization
theta_i^init (drawn as the run draws theta^0, seeded by theta^0 and the client id) in place of theta^0; the server
still counts theta^0 for a client it has not heard from. `server_augment: crop_flip` crops and flips D_s afresh every
round (the authors' CRD loaders); client data are never augmented by it.

`diagnostics: true` (AugFL, the convergence analysis): each client evaluates its part of the augmented Lagrangian (5),
w_i L_i(phi_i(theta_i), D^q) with phi_i(theta_i) = theta_i - alpha grad L_i(theta_i, D^s) (two more full gradients),
and sends it, the change of q_i = <y_i, theta_i> + rho/2 ||theta_i||^2 and w_i d_i beside its upload (not counted as
traffic). The server keeps G = sum_i w_i L_i(phi_i(theta_i), D^q) and Q = sum_i q_i over ALL clients (their latest
values) and logs, at the theta^t the round's clients received,

    lagrangian = G + Q - <sum_i (y_i + rho theta_i), theta^t> + m rho/2 ||theta^t||^2 + lambda R_h(theta^t, theta_p)
    fosp_norm  = ||sum_i w_i d_i + lambda grad R_h(theta^t, theta_p)||         (the eps-FOSP criterion, Theorem 1)

(the Lagrangian once every client has reported), `regularizer` = R_h(theta^t) (||theta - theta_p||^2; for CRD the
transfer pass's mean loss), and with a teacher the meta-model's loss, accuracy and gradient norm on the teacher's
pretraining pool (`pretrain_*`: forgetting of the pretrained model's task, Theorem 3); each client logs its
delta_{i,t} (`delta`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.algorithms.augfl.settings import AugFlSettings
from raysim.algorithms.augfl.teacher import teacher_architecture
from raysim.algorithms.families.teacher import check_pools, pretrained_parameters
from raysim.algorithms.interface import (
    ALGORITHMS,
    NOT_SENT,
    AdaptStep,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerContext,
    Upload,
)
from raysim.algorithms.requests import FullGradient, Number, ServerDataStep, Vector, gradient
from raysim.data.augment import crop_flip
from raysim.data.dataset import Task
from raysim.examples import ExampleContext, Fragment
from raysim.seeding import Stream, rng, torch_seed

if TYPE_CHECKING:
    from raysim.algorithms.augfl.crd import ContrastiveTransfer, CrdState
    from raysim.models.flat import FlatModel


PADDING = 4
"""`server_augment: crop_flip`: the pixels added on each side before the crop (the authors' RandomCrop(padding=4))."""


@dataclass(frozen=True, eq=False)
class AugFlServerData:
    """What only AugFL's coordinator holds: the teacher theta_p for R_h (eq. 13) and the transfer set D_s (AugFL,
    Sec. V)."""

    pretrained: Vector
    """theta_p, the flat parameters of the teacher."""
    pretrained_model: str
    """Its architecture (raysim.models.zoo name); it may differ from the clients' model."""
    x: np.ndarray
    y: np.ndarray
    """D_s: the samples of the knowledge transfer."""
    model: str
    """The clients' (and global) model architecture."""
    input_shape: tuple[int, ...]
    num_classes: int
    seed: int
    pretraining_x: np.ndarray | None = None
    pretraining_y: np.ndarray | None = None
    """The teacher's pretraining pool, for the forgetting diagnostics (`diagnostics: true`); None otherwise."""
    task: Task = "classification"


@dataclass
class AugFlClientState:
    y: Vector
    """y_i, the dual (= -w_i times the meta-gradient estimate after the first participation, AugFL, eq. (83))."""
    theta: Vector
    """theta_i, the last local meta-model (theta^0, what the server counts, before the first participation)."""
    phi: Vector
    """phi_i, the model adapted from the last received theta (the personalized model); before the first
    participation the client's starting model: theta^0, or its own initialization (`start: own`)."""
    participations: int
    reported_smooth: Number = math.nan
    """With `diagnostics: true`: w_i L_i(phi_i(theta_i), D^q) at the client's last report, NaN before."""


@dataclass
class AugFlServerState:
    theta: Vector
    total: np.ndarray
    """float64 sum over all m clients of y_i + rho theta_i (their latest values)."""
    num_clients: int
    transfer: CrdState | None = None
    """The CRD heads and memory banks (regularizer crd)."""
    rounds: int = 0
    """Server steps taken: 0 before round 0's aggregation (`start: own` broadcasts nothing then)."""
    diagnostics: AugFlTotals | None = None
    """The running totals over all m clients behind `diagnostics: true`; None otherwise."""


@dataclass
class AugFlTotals:
    """Running totals over ALL m clients (their latest values) for the augmented Lagrangian (5)."""

    smooth_sum: float
    """G = sum of the reported w_i L_i(phi_i(theta_i), D^q)."""
    coupling_sum: float
    """Q = sum_i <y_i, theta_i> + rho/2 ||theta_i||^2 (theta_i = theta^0, y_i = 0 before a client's first step)."""
    reported: int = 0
    """How many clients have reported at least once."""


@dataclass
class AugFlUpload(Upload):
    """theta_i and y_i, sent as their changes so that the server can keep its sum over all clients exact."""

    delta_y: Vector
    delta_theta: Vector


@dataclass
class AugFlDiagnosticUpload(AugFlUpload):
    """The upload with the diagnostics of `diagnostics: true` (summed by the runtime, not counted as uplink)."""

    weighted_gradient: Vector = field(metadata=NOT_SENT)
    """w_i d_i, the weighted meta-gradient estimate at the received theta^t: its sum enters the eps-FOSP norm."""
    smooth_change: Number = field(metadata=NOT_SENT)
    """w_i L_i(phi_i(theta_i), D^q) less its last report (all of it at the first): moves G."""
    first_reports: Number = field(metadata=NOT_SENT)
    """1 at the client's first report, else 0."""
    coupling_change: Number = field(metadata=NOT_SENT)
    """q_i new less q_i old: moves Q."""


@ALGORITHMS.register()
class AugFl(Algorithm[AugFlSettings, AugFlClientState, AugFlServerState, Vector | None, AugFlUpload]):
    name = "augfl"
    Settings = AugFlSettings
    Upload = AugFlUpload
    _teacher: np.ndarray | None = None
    _transfer: ContrastiveTransfer | None = None
    _server_data: AugFlServerData | None = None
    _pretraining: FlatModel | None = None
    _forgetting_pool: tuple[np.ndarray, np.ndarray] | None = None
    _initializer: Any = None

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """A small AugFL as the paper runs it: CRD from an MLP teacher pretrained for one epoch (64 negatives), on
        the meta partition whose held-back pools it needs, with a quarter of the clients held out as targets."""
        from raysim.data.meta_partition import MetaSettings

        algorithm = {
            "name": cls.name,
            "regularizer": "crd",
            "transfer": {"negatives": 64},
            "teacher_model": "mlp",
            "teacher_epochs": 1,
        }
        clients = {**context.base.get("clients", {}), "heldout": 0.25}
        return {"algorithm": algorithm, "clients": clients, **MetaSettings.example(context)}

    def regularized(self) -> bool:
        """Whether the server step has a regularizer R_h (lambda > 0), hence needs theta_p and D_s."""
        return self.settings.regularizer != "none" and self.settings.lam > 0

    def server_data(self, context: ServerContext) -> ServerDataStep | None:
        """theta_p (`teacher_weights`, or pretrained and cached, raysim.algorithms.augfl.teacher) and D_s from the
        partition's held-back pools; None without a regularizer."""
        return self._prepare_server_data(context) if self.regularized() else None

    def _prepare_server_data(self, context: ServerContext) -> ServerDataStep:
        s = self.settings
        check_pools(context, f"algorithm {self.name!r} with a teacher")
        architecture = teacher_architecture(s, context.model, context.input_shape)
        params = yield from pretrained_parameters(s, context, architecture)
        transfer = context.pools[1]
        pool = context.pools[0] if s.diagnostics else None  # forgetting: the teacher's task
        return AugFlServerData(
            params,
            architecture,
            transfer.x,
            transfer.y,
            context.model,
            context.input_shape,
            context.num_classes,
            context.seed,
            None if pool is None else pool.x,
            None if pool is None else pool.y,
            context.task,
        )

    def setup_server(self, data: AugFlServerData) -> None:
        """Keep theta_p (l2) or build the CRD machinery on the transfer set (crd), and with `diagnostics` the model
        that scores the teacher's pretraining task; coordinator only."""
        if data.pretraining_x is not None and data.pretraining_y is not None and self.settings.diagnostics:
            from raysim.models.flat import FlatModel  # torch: on the coordinator only

            self._pretraining = FlatModel(data.model, data.input_shape, data.num_classes, data.task)
            self._forgetting_pool = (np.array(data.pretraining_x), np.array(data.pretraining_y))  # writable copies
        if self.settings.regularizer == "l2":
            if data.pretrained.shape != (self.params.size,):
                raise ValueError(
                    f"algorithm.teacher_weights: the teacher has {data.pretrained.size} parameters, the model "
                    f"{self.params.size}"
                )
            self._teacher = data.pretrained.astype(np.float64)
            return
        self._server_data = data
        self._transfer = self._contrastive(data.x)

    def _contrastive(self, x: np.ndarray) -> ContrastiveTransfer:
        """The CRD machinery on the transfer samples `x` (D_s, or this round's augmented D_s)."""
        from raysim.algorithms.augfl.crd import ContrastiveTransfer  # torch: on the coordinator only
        from raysim.models.flat import FlatModel

        data = self._server_data
        assert data is not None  # setup_server keeps it before building the transfer
        student = FlatModel(data.model, data.input_shape, data.num_classes)
        teacher = FlatModel(data.pretrained_model, data.input_shape, data.num_classes)
        return ContrastiveTransfer(self.settings.transfer, student, teacher, data.pretrained, x, data.y, data.seed)

    def augmented_transfer_set(self, x: np.ndarray, round_index: int, seed: int) -> np.ndarray:
        """D_s cropped and flipped for the transfer pass of server round `round_index` (`server_augment`): as the
        authors' loaders, RandomCrop(size, padding=4) then RandomHorizontalFlip, drawn from the server's stream.
        The samples are already normalized; the padding takes each channel's darkest value in D_s, the normalized
        black pixel that torchvision pads the raw image with before Normalize."""
        if x.ndim != 4:
            raise ValueError(f"algorithm.server_augment=crop_flip crops images (n, C, H, W); D_s has shape {x.shape}")
        n = len(x)
        generator = rng(seed, Stream.SERVER, round_index, 1)
        corners = generator.integers(0, 2 * PADDING + 1, size=(n, 2))  # each crop's top-left corner in the padding
        flips = np.asarray(generator.random(n) < 0.5)
        return crop_flip(x, corners, flips, PADDING, fill=x.min(axis=(0, 2, 3)))

    def init_server(self, init_params: Vector, num_clients: int) -> AugFlServerState:
        # y_i^{-1} = 0 (authors' code) and theta_i^{-1} = theta^0 for every client.
        theta = init_params.astype(np.float64)
        total = num_clients * self.settings.rho * theta
        transfer = self._transfer.init_state() if self._transfer is not None else None
        totals = None
        if self.settings.diagnostics:
            totals = AugFlTotals(0.0, num_clients * self.settings.rho / 2 * float(theta @ theta))
        return AugFlServerState(init_params.copy(), total, num_clients, transfer, 0, totals)

    def init_client(self, client: ClientInfo, init_params: Vector) -> AugFlClientState:
        start = self.own_initialization(client.id, init_params) if self.own_start else init_params.copy()
        return AugFlClientState(np.zeros_like(init_params), init_params.copy(), start, 0)

    @property
    def own_start(self) -> bool:
        return self.settings.start == "own"

    def own_initialization(self, client_id: int, init_params: Vector) -> Vector:
        """Client `client_id`'s own initial model (`start: own`): the network's initializer, as the run draws theta^0,
        from a seed of theta^0 (hence of the experiment's seed) and the client id."""
        from raysim.models.zoo import build_module, initial_parameters  # torch: where clients train

        if not self.params.model or not self.params.head:
            raise ValueError("algorithm.start=own: the model's layout names no registered network to initialize")
        if self._initializer is None:
            outputs = self.params.shapes[self.params.names.index(self.params.head[0])][0]
            self._initializer = build_module(self.params.model, self.params.input_shape, outputs)
        seed = torch_seed(zlib.crc32(np.ascontiguousarray(init_params).tobytes()), Stream.MODEL_INIT, client_id)
        own = initial_parameters(self._initializer, seed).numpy()
        if own.shape != init_params.shape:
            raise ValueError(
                f"algorithm.start=own: the client's model has {own.size} values, theta^0 {init_params.size}"
            )
        return own

    def broadcast(self, server: AugFlServerState) -> Vector | None:
        """theta^t; nothing in round 0 with `start: own` (each client starts from its own model)."""
        return None if self.own_start and server.rounds == 0 else server.theta

    def delta(self, participation: int) -> float:
        return 1.0 / (self.settings.delta_scale * participation + self.settings.delta_offset)

    def client_step(self, client: ClientInfo, state: AugFlClientState, broadcast: Vector | None) -> ClientStep:
        s = self.settings
        if broadcast is None:  # start: own, round 0: the client's own initialization stands for theta^t
            broadcast = state.phi
        theta = broadcast.astype(np.float64)
        support = yield from gradient(FullGradient(broadcast, s.support_split))
        phi = theta - s.alpha * support.grad  # (7)
        query = yield from gradient(FullGradient(phi.astype(np.float32), s.query_split))
        r = query.grad.astype(np.float64)
        k = state.participations + 1
        g = np.zeros_like(theta)
        if s.hessian == "finite_difference":
            delta = self.delta(k)
            plus = yield from gradient(FullGradient((theta + delta * r).astype(np.float32), s.support_split))
            minus = yield from gradient(FullGradient((theta - delta * r).astype(np.float32), s.support_split))
            g = (plus.grad.astype(np.float64) - minus.grad) / (2 * delta)  # (10)
        meta_gradient = r - s.alpha * g
        theta_i = theta - (state.y + client.weight * meta_gradient) / s.rho  # (11)
        y = state.y + s.rho * (theta_i - theta)  # (12)
        new = AugFlClientState(y.astype(np.float32), theta_i.astype(np.float32), phi.astype(np.float32), k)
        metrics = {
            "support_loss": support.loss,
            "query_loss": query.loss,
            "primal_residual": float(np.linalg.norm(theta_i - theta)),
            "dual_change": float(np.linalg.norm(y - state.y)),
            "meta_gradient_norm": float(np.linalg.norm(meta_gradient)),
        }
        delta_y = (y - state.y).astype(np.float64)
        delta_theta = (theta_i - state.theta.astype(np.float64)).astype(np.float64)
        if not s.diagnostics:
            return ClientUpdate(new, AugFlUpload(delta_y, delta_theta), metrics)
        # (5): the client's smooth part w_i L_i(phi_i(theta_i), D^q) at its new theta_i (as sent, float32)
        theta_new, y_new = new.theta.astype(np.float64), new.y.astype(np.float64)
        at_theta = yield from gradient(FullGradient(new.theta, s.support_split))
        adapted = (theta_new - s.alpha * at_theta.grad).astype(np.float32)
        smooth = client.weight * (yield from gradient(FullGradient(adapted, s.query_split))).loss
        first = math.isnan(state.reported_smooth)
        metrics["delta"] = self.delta(k) if s.hessian == "finite_difference" else 0.0
        upload = AugFlDiagnosticUpload(
            delta_y,
            delta_theta,
            client.weight * meta_gradient,
            smooth - (0.0 if first else state.reported_smooth),
            float(first),
            self._coupling(y_new, theta_new) - self._coupling(state.y, state.theta),
        )
        return ClientUpdate(replace(new, reported_smooth=smooth), upload, metrics)

    def _coupling(self, y: Vector, theta: Vector) -> float:
        """q_i = <y_i, theta_i> + rho/2 ||theta_i||^2 in float64: the client's part of Q (module docstring)."""
        y64, theta64 = np.asarray(y, np.float64), np.asarray(theta, np.float64)
        return float(y64 @ theta64 + self.settings.rho / 2 * (theta64 @ theta64))

    def adapt(self, client: ClientInfo, global_params: Vector) -> AdaptStep:
        """A target client's personalized model: one step from theta on its support set (eq. 7)."""
        support = yield from gradient(FullGradient(global_params, self.settings.support_split))
        return (global_params.astype(np.float64) - self.settings.alpha * support.grad).astype(np.float32)

    def regularizer_gradient(self, server: AugFlServerState) -> tuple[np.ndarray, CrdState | None, dict]:
        """grad_theta R_h(theta^t, theta_p) (eq. 13), the transfer state after it, and its metrics."""
        theta = server.theta.astype(np.float64)
        if not self.regularized():
            return np.zeros_like(theta), server.transfer, {}
        if self.settings.regularizer == "l2":
            if self._teacher is None:
                raise RuntimeError("AugFL: setup_server was not called with the teacher")
            return 2.0 * (theta - self._teacher), None, {}
        if self._transfer is None or server.transfer is None or self._server_data is None:
            raise RuntimeError("AugFL: setup_server was not called with the teacher and transfer set")
        transfer = self._transfer
        if self.settings.server_augment == "crop_flip":
            data = self._server_data
            transfer = self._contrastive(self.augmented_transfer_set(data.x, server.rounds, data.seed))
        return transfer.gradient(server.theta, server.transfer)

    def regularizer_value(self, server: AugFlServerState, metrics: dict[str, float]) -> float:
        """R_h(theta^t, theta_p): ||theta^t - theta_p||^2 (l2); for CRD the transfer pass's mean loss (the contrastive
        bound at theta^t in paper mode; the code's CE + CRD in code mode); 0 without a regularizer."""
        if not self.regularized():
            return 0.0
        if self.settings.regularizer == "l2":
            assert self._teacher is not None  # regularizer_gradient checked it
            gap = server.theta.astype(np.float64) - self._teacher
            return float(gap @ gap)
        return float(metrics["transfer_loss"])

    def server_step(self, server: AugFlServerState, total: AugFlUpload, num_selected: int):
        s = self.settings
        summed = server.total + total.delta_y + s.rho * total.delta_theta
        reg, transfer, metrics = self.regularizer_gradient(server)
        theta = ((summed - s.lam * reg) / (server.num_clients * s.rho)).astype(np.float32)  # (13)
        metrics = {
            **metrics,
            "global_change": float(np.linalg.norm(theta - server.theta)),
            "regularizer_gradient_norm": float(np.linalg.norm(reg)),
            "effective_step": 1.0 / (server.num_clients * s.rho),
        }
        totals = server.diagnostics
        if isinstance(total, AugFlDiagnosticUpload) and totals is not None:
            totals, diagnostics = self._diagnostics(server, totals, total, summed, reg, metrics)
            metrics |= diagnostics
        return AugFlServerState(theta, summed, server.num_clients, transfer, server.rounds + 1, totals), metrics

    def _diagnostics(
        self,
        server: AugFlServerState,
        totals: AugFlTotals,
        total: AugFlDiagnosticUpload,
        summed: np.ndarray,
        reg: np.ndarray,
        metrics: dict[str, float],
    ) -> tuple[AugFlTotals, dict[str, float]]:
        """The running totals after this round's reports and the diagnostics at theta^t (module docstring)."""
        s, m = self.settings, server.num_clients
        totals = AugFlTotals(
            totals.smooth_sum + float(total.smooth_change),
            totals.coupling_sum + float(total.coupling_change),
            totals.reported + round(float(total.first_reports)),
        )
        theta = server.theta.astype(np.float64)
        regularizer = self.regularizer_value(server, metrics)
        out = {
            "fosp_norm": float(np.linalg.norm(total.weighted_gradient + s.lam * reg)),
            "regularizer": regularizer,
        }
        if totals.reported == m:  # (5) over all clients: the coupling sum_i <y_i, theta_i - theta> + rho/2 ||.||^2
            coupling = totals.coupling_sum - float(summed @ theta) + m * s.rho / 2 * float(theta @ theta)
            out["lagrangian"] = totals.smooth_sum + coupling + s.lam * regularizer
        if self._pretraining is not None:
            out |= self.forgetting(server.theta)
        return totals, out

    def forgetting(self, theta: Vector) -> dict[str, float]:
        """The meta-model theta on the teacher's pretraining pool: its loss L_p, accuracy and ||grad L_p(theta)||
        (Theorem 3 bounds the last one: how much of the pretrained model's task a suitable lambda keeps)."""
        import torch

        model, pool = self._pretraining, self._forgetting_pool
        assert model is not None and pool is not None  # setup_server keeps both
        x, y = pool
        point = torch.from_numpy(np.array(theta, dtype=np.float32)).requires_grad_(True)
        loss_sum, correct, gradient_sum = 0.0, 0, torch.zeros_like(point)
        for start in range(0, len(y), 1024):
            xb, yb = torch.from_numpy(x[start : start + 1024]), torch.from_numpy(y[start : start + 1024])
            outputs = model.forward(point, xb)
            loss = model._loss(outputs, yb) * len(yb)
            (batch_gradient,) = torch.autograd.grad(loss, point)
            loss_sum, gradient_sum = loss_sum + float(loss.detach()), gradient_sum + batch_gradient
            if model.task == "classification":
                correct += int((outputs.argmax(1) == yb).sum())
        out = {
            "pretrain_loss": loss_sum / len(y),
            "pretrain_gradient_norm": float(torch.linalg.norm(gradient_sum / len(y))),
        }
        if model.task == "classification":
            out["pretrain_acc"] = correct / len(y)
        return out

    def global_model(self, server: AugFlServerState) -> Vector:
        return server.theta

    def personalized_model(self, state: AugFlClientState) -> Vector:
        return state.phi
