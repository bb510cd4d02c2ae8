"""AugFL: inexact-ADMM federated meta-learning with a server-side pretrained-model regularizer (augfl.md 1.6).

Client i, given the meta-model theta^t, with full-batch gradients on its support set (`support_split`)
and query set (`query_split`):

    phi_i   = theta - alpha grad L_i(theta, D^s)                                          (7)
    r_i     = grad L_i(phi_i, D^q)
    g_i     = [grad L_i(theta + delta r_i, D^s) - grad L_i(theta - delta r_i, D^s)] / (2 delta)   (10)
    theta_i = theta - (y_i + w_i (r_i - alpha g_i)) / rho                                 (11)
    y_i     = y_i + rho (theta_i - theta)                                                 (12)

with delta = 1/(10k + 100) at the client's k-th participation (k = 1, 2, ...). The server keeps the sum
over ALL clients of y_i + rho theta_i (unselected clients count with their last values, augfl.md 1.8(f))
and sets theta^{t+1} = (sum_i (y_i + rho theta_i) - lambda grad R_h(theta^t, theta_p)) / (m rho)   (13).

R_h is `regularizer`: `crd` (the paper: contrastive representation distillation from a larger
pretrained model, the teacher, `transfer.mode` paper or the authors' code; raysim.algorithms.augfl.crd), `l2` =
||theta - theta_p||^2 (the theory's same-architecture case) or `none` (AugFL without the pretrained model).

The teacher theta_p and the transfer set D_s come from the two pools the `meta` partition keeps back from every
client (augfl.md 4.1): `server_data` reads theta_p from the weights file `teacher_weights` that `raysim pretrain`
wrote (checksum, model and classes verified), or trains it on the first pool by asking the runtime for a `TrainModel`
request (the authors' recipe of `teacher_*`; raysim.algorithms.augfl.teacher) unless it is cached, and returns it
with D_s, the second pool, as `AugFlServerData`; the
runtime hands that to `setup_server` on the coordinator only, never to a client host.

Held-out target clients (`clients.heldout`, 0.2 in the paper) are scored after `adapt`: one step from the
current theta on their support set (augfl.md 2.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from raysim.algorithms.augfl.settings import AugFlSettings
from raysim.algorithms.augfl.teacher import teacher_architecture
from raysim.algorithms.families.teacher import check_pools, pretrained_parameters
from raysim.algorithms.interface import (
    ALGORITHMS,
    AdaptStep,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerContext,
    Upload,
)
from raysim.algorithms.requests import FullGradient, ServerDataStep, Vector, gradient
from raysim.examples import ExampleContext, Fragment

if TYPE_CHECKING:
    from raysim.algorithms.augfl.crd import ContrastiveTransfer, CrdState


@dataclass(frozen=True, eq=False)
class AugFlServerData:
    """What only AugFL's coordinator holds: the teacher theta_p for R_h (eq. 13) and the transfer set D_s (augfl.md
    2.1)."""

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


@dataclass
class AugFlClientState:
    y: Vector
    """y_i, the dual (= -w_i times the meta-gradient estimate after the first participation, augfl.md 1.8(a))."""
    theta: Vector
    """theta_i, the last local meta-model."""
    phi: Vector
    """phi_i, the model adapted from the last received theta (the personalized model)."""
    participations: int


@dataclass
class AugFlServerState:
    theta: Vector
    total: np.ndarray
    """float64 sum over all m clients of y_i + rho theta_i (their latest values)."""
    num_clients: int
    transfer: CrdState | None = None
    """The CRD heads and memory banks (regularizer crd)."""


@dataclass
class AugFlUpload(Upload):
    """theta_i and y_i, sent as their changes so that the server can keep its sum over all clients exact."""

    delta_y: Vector
    delta_theta: Vector


@ALGORITHMS.register()
class AugFl(Algorithm[AugFlSettings, AugFlClientState, AugFlServerState, Vector, AugFlUpload]):
    name = "augfl"
    Settings = AugFlSettings
    Upload = AugFlUpload
    _teacher: np.ndarray | None = None
    _transfer: ContrastiveTransfer | None = None

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
        return self._server_data(context) if self.regularized() else None

    def _server_data(self, context: ServerContext) -> ServerDataStep:
        s = self.settings
        check_pools(context, f"algorithm {self.name!r} with a teacher")
        architecture = teacher_architecture(s, context.model, context.input_shape)
        params = yield from pretrained_parameters(s, context, architecture)
        transfer = context.pools[1]
        return AugFlServerData(
            params,
            architecture,
            transfer.x,
            transfer.y,
            context.model,
            context.input_shape,
            context.num_classes,
            context.seed,
        )

    def setup_server(self, data: AugFlServerData) -> None:
        """Keep theta_p (l2) or build the CRD machinery on the transfer set (crd); coordinator only."""
        if self.settings.regularizer == "l2":
            if data.pretrained.shape != (self.params.size,):
                raise ValueError(
                    f"algorithm.teacher_weights: the teacher has {data.pretrained.size} parameters, the model "
                    f"{self.params.size}"
                )
            self._teacher = data.pretrained.astype(np.float64)
            return
        from raysim.algorithms.augfl.crd import ContrastiveTransfer  # torch: on the coordinator only
        from raysim.models.flat import FlatModel

        student = FlatModel(data.model, data.input_shape, data.num_classes)
        teacher = FlatModel(data.pretrained_model, data.input_shape, data.num_classes)
        self._transfer = ContrastiveTransfer(
            self.settings.transfer, student, teacher, data.pretrained, data.x, data.y, data.seed
        )

    def init_server(self, init_params: Vector, num_clients: int) -> AugFlServerState:
        # y_i^{-1} = 0 (authors' code) and theta_i^{-1} = theta^0 for every client.
        total = num_clients * self.settings.rho * init_params.astype(np.float64)
        transfer = self._transfer.init_state() if self._transfer is not None else None
        return AugFlServerState(init_params.copy(), total, num_clients, transfer)

    def init_client(self, client: ClientInfo, init_params: Vector) -> AugFlClientState:
        return AugFlClientState(np.zeros_like(init_params), init_params.copy(), init_params.copy(), 0)

    def broadcast(self, server: AugFlServerState) -> Vector:
        return server.theta

    def delta(self, participation: int) -> float:
        return 1.0 / (self.settings.delta_scale * participation + self.settings.delta_offset)

    def client_step(self, client: ClientInfo, state: AugFlClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
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
        upload = AugFlUpload(
            (y - state.y).astype(np.float64), (theta_i - state.theta.astype(np.float64)).astype(np.float64)
        )
        return ClientUpdate(new, upload, metrics)

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
        if self._transfer is None or server.transfer is None:
            raise RuntimeError("AugFL: setup_server was not called with the teacher and transfer set")
        return self._transfer.gradient(server.theta, server.transfer)

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
        return AugFlServerState(theta, summed, server.num_clients, transfer), metrics

    def global_model(self, server: AugFlServerState) -> Vector:
        return server.theta

    def personalized_model(self, state: AugFlClientState) -> Vector:
        return state.phi
