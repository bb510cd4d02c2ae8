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
pretrained model, the teacher, `transfer.mode` paper or the authors' code; raysim.algorithms.crd), `l2` =
||theta - theta_p||^2 (the theory's same-architecture case) or `none` (AugFL without the pretrained model).

The pretrained model theta_p and the transfer set D_s come from the two pools the `meta` partition keeps back
from every client (augfl.md 4.1): `server_data` trains theta_p on the first pool by asking the runtime for a
`TrainModel` request (mini-batch SGD, momentum 0.9, batch 64, `pm_epochs` at `pm_lr`) unless it is cached or
given as `pm_path`, and returns it with D_s, the second pool, as `AugFlServerData`; the runtime hands that to
`setup_server` on the coordinator only, never to a client host. The cache is `$RAYSIM_CACHE/pm/` (default
~/.cache/raysim/pm/), one flat float32 .npy per dataset, architecture, seed, pool sizes, epochs and rate;
`raysim pretrain CONFIG` (raysim.launch.pretrain) fills it ahead of time.

Held-out target clients (`clients.heldout`, 0.2 in the paper) are scored after `adapt`: one step from the
current theta on their support set (augfl.md 2.3).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.base import (
    ALGORITHMS,
    AdaptStep,
    Algorithm,
    AlgorithmSettings,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    FullGradient,
    LocalSGD,
    ServerContext,
    ServerDataStep,
    SGDResult,
    TrainModel,
    Upload,
    Vector,
)
from raysim.errors import ConfigError
from raysim.examples import ExampleContext, Fragment
from raysim.models.spec import ModelChoice
from raysim.seeding import Stream, torch_seed
from raysim.settings import Settings

if TYPE_CHECKING:
    from raysim.algorithms.crd import ContrastiveTransfer
    from raysim.models.flat import FlatModel


class TransferSettings(Settings):
    """`algorithm.transfer`: how the teacher's knowledge reaches the meta-model (augfl.md 2, 8.5)."""

    mode: Literal["paper", "code"] = Field(
        "paper", description="grad of the CRD bound at theta^t (paper) or the code's epoch-averaged CE + CRD gradient"
    )
    feat_dim: int = Field(128, ge=1, description="dimension of the common embedding space of f^s and f^c")
    temperature: float = Field(0.07, gt=0, description="tau, the NCE temperature")
    negatives: int = Field(16384, ge=1, description="K negatives per positive (capped at |D_s| - 1)")
    memory_momentum: float = Field(0.5, ge=0, lt=1, description="momentum of the memory-bank updates")
    batch_size: int = Field(128, ge=1, description="knowledge-transfer batch size (Table I)")
    lr: float = Field(0.002, gt=0, description="SGD rate of the heads (and, in code mode, of the student copy)")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    ce_weight: float = Field(1.0, ge=0, description="code mode: weight of the cross-entropy on D_s's labels")
    crd_weight: float = Field(0.8, ge=0, description="code mode: weight of the CRD term")


@dataclass
class CrdState:
    """What persists between rounds on the server (all float32 arrays, checkpointable)."""

    heads: Vector
    """Flat parameters of f^s then f^c."""
    head_velocity: Vector
    student_velocity: Vector
    """Momentum of the student copy (code mode; zeros otherwise)."""
    memory_student: np.ndarray
    memory_teacher: np.ndarray
    normalizers: Vector
    """(Z_student_side, Z_teacher_side); NaN until the first batch sets them."""
    rounds: int


class AugFlSettings(AlgorithmSettings):
    name: Literal["augfl"] = "augfl"
    alpha: float = Field(0.03, gt=0, description="alpha: one-step adaptation rate (0.03 in the paper, Table I)")
    rho: float = Field(0.7, gt=0, description="rho_i: ADMM penalty, the same for every client (Table I)")
    lam: float = Field(5.0, ge=0, alias="lambda", description="lambda: weight of the regularizer R_h (Table I)")
    hessian: Literal["finite_difference", "first_order"] = Field(
        "finite_difference", description="g_i by eq. 10 (paper) or g_i = 0 (first-order ablation)"
    )
    delta_scale: float = Field(10.0, gt=0, description="delta_k = 1/(delta_scale k + delta_offset): 1/(10k + 100)")
    delta_offset: float = Field(100.0, gt=0)
    support_split: Literal["train", "val", "test"] = Field("train", description="the client's split used as D^s")
    query_split: Literal["train", "val", "test"] = Field(
        "test", description="the client's split used as D^q (the meta partition's test split is the query set)"
    )
    regularizer: Literal["crd", "l2", "none"] = Field(
        "crd",
        description="R_h: contrastive distillation from the pretrained model (paper), ||theta - theta_p||^2 (same "
        "architecture) or none (AugFL without the pretrained model)",
    )
    transfer: TransferSettings = Field(default_factory=TransferSettings, description="CRD settings (regularizer crd)")
    pm_model: ModelChoice | None = Field(
        None,
        description="the pretrained model's architecture; default: the next larger model (mlp -> cnn), the "
        "clients' model for l2",
    )
    pm_path: str | None = Field(None, description="flat float32 .npy of theta_p; default: pretrained and cached")
    pm_epochs: int = Field(5, ge=1, description="pretraining epochs on the reserved pool (raysim pretrain)")
    pm_lr: float = Field(0.05, gt=0, description="pretraining learning rate")


LARGER = {"mlr": "mlp", "linear": "mlp", "mlp": "cnn", "cnn": "resnet18_gn", "resnet18_gn": "resnet18_gn"}
"""The default architecture of the pretrained model for each client model: the next larger network of the zoo
(the paper distils a ResNet32x4 into a ResNet8x4)."""


def teacher_architecture(settings: AugFlSettings, model: str, input_shape: tuple[int, ...]) -> str:
    """The pretrained model's architecture: `pm_model`, or by default the clients' `model` for the L2 regularizer
    (it compares parameters) and the next larger network for CRD (mlp on non-image input)."""
    explicit = settings.pm_model
    if settings.regularizer == "l2":
        if explicit not in (None, model):
            raise ConfigError(
                f"algorithm.pm_model={explicit}: regularizer l2 compares parameters, so the pretrained model must be "
                f"the clients' model ({model}); use regularizer crd for a different architecture"
            )
        return model
    if explicit is not None:
        return explicit
    if model not in LARGER:
        raise ConfigError(
            f"algorithm.pm_model: model.name={model} has no default teacher architecture (defaults exist for "
            f"{', '.join(LARGER)}); set algorithm.pm_model"
        )
    larger = LARGER[model]
    return larger if len(input_shape) == 3 or larger in ("mlp", "mlr") else "mlp"


def _teacher_model(architecture: str, context: ServerContext) -> FlatModel:
    from raysim.models.flat import FlatModel  # in the driver, which prepares the server data

    try:
        return FlatModel(architecture, context.input_shape, context.num_classes, context.task)
    except ValueError as error:
        raise ConfigError(f"algorithm.pm_model: {error}") from None


def pretrained_cache_path(folder: Path, context: ServerContext, architecture: str, epochs: int, lr: float) -> Path:
    """The cached pretrained model of this dataset, architecture, seed, pool sizes, epochs and rate in `folder`."""
    pool, held = len(context.pools[0].y), sum(len(p.y) for p in context.pools)
    name = f"{context.dataset}-{architecture}-seed{context.seed}-pool{pool}-held{held}-e{epochs}-lr{lr:g}.npy"
    return folder.expanduser() / name


def _check_pools(context: ServerContext, purpose: str) -> None:
    if len(context.pools) != 2:
        raise ConfigError(
            f"partition.scheme={context.partition}: {purpose} needs 'meta' (its held-back pools feed the "
            "pretrained model and the server's transfer set)"
        )


def pretrain(
    context: ServerContext, architecture: str, epochs: int, lr: float, folder: Path
) -> Generator[TrainModel, SGDResult, Path]:
    """Train (or reuse) the pretrained model on the first held-back pool (augfl.md 4.1) and return the path of its
    flat float32 parameters in `folder`: the training is one `TrainModel` request (mini-batch SGD, momentum 0.9,
    batch 64, from an initialization of its own), yielded only when the file is not cached yet."""
    _check_pools(context, "pretraining")
    path = pretrained_cache_path(folder, context, architecture, epochs, lr)
    if path.exists():
        return path
    model = _teacher_model(architecture, context)
    start = model.initial_parameters(torch_seed(context.seed, Stream.MODEL_INIT, 1))
    pool = context.pools[0]
    result = yield TrainModel(architecture, pool.x, pool.y, LocalSGD(start, epochs, lr, 64, momentum=0.9))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp.npy")
    np.save(temporary, result.params.astype(np.float32))
    temporary.replace(path)  # never a half-written file under the final name
    return path


@dataclass(frozen=True, eq=False)
class AugFlServerData:
    """What only AugFL's coordinator holds: theta_p for R_h (eq. 13) and the transfer set D_s (augfl.md 2.1)."""

    pretrained: Vector
    """theta_p, the flat parameters of the pretrained model."""
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
    _pm: np.ndarray | None = None
    _transfer: ContrastiveTransfer | None = None

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """A small AugFL as the paper runs it: CRD from an MLP teacher pretrained for one epoch (64 negatives), on
        the meta partition whose held-back pools it needs, with a quarter of the clients held out as targets."""
        from raysim.data.meta_partition import MetaSettings

        algorithm = {"name": cls.name, "regularizer": "crd", "transfer": {"negatives": 64}, "pm_model": "mlp",
                     "pm_epochs": 1}  # fmt: skip
        clients = {**context.base.get("clients", {}), "heldout": 0.25}
        return {"algorithm": algorithm, "clients": clients, **MetaSettings.example(context)}

    def regularized(self) -> bool:
        """Whether the server step has a regularizer R_h (lambda > 0), hence needs theta_p and D_s."""
        return self.settings.regularizer != "none" and self.settings.lam > 0

    def server_data(self, context: ServerContext) -> ServerDataStep | None:
        """theta_p (`pm_path`, or pretrained and cached, see `pretrain`) and D_s from the partition's held-back
        pools; None without a regularizer."""
        return self._server_data(context) if self.regularized() else None

    def _server_data(self, context: ServerContext) -> ServerDataStep:
        s = self.settings
        _check_pools(context, f"algorithm {self.name!r} with a pretrained model")
        architecture = teacher_architecture(s, context.model, context.input_shape)
        if s.pm_path:
            path = Path(s.pm_path).expanduser()
        else:
            path = yield from pretrain(context, architecture, s.pm_epochs, s.pm_lr, context.cache / "pm")
        try:
            params = np.load(path).astype(np.float32)
        except (OSError, ValueError) as error:
            raise ConfigError(f"algorithm.pm_path: cannot read {path} ({error})") from None
        expected = _teacher_model(architecture, context).size
        if params.shape != (expected,):
            raise ConfigError(
                f"algorithm.pm_path: {path} holds {params.size} parameters, the pretrained model's architecture "
                f"{architecture} has {expected} (set algorithm.pm_model to its architecture)"
            )
        transfer = context.pools[1]
        return AugFlServerData(
            params, architecture, transfer.x, transfer.y, context.model, context.input_shape, context.num_classes,
            context.seed,
        )  # fmt: skip

    def setup_server(self, data: AugFlServerData) -> None:
        """Keep theta_p (l2) or build the CRD machinery on the transfer set (crd); coordinator only."""
        if self.settings.regularizer == "l2":
            if data.pretrained.shape != (self.params.size,):
                raise ValueError(
                    f"algorithm.pm_path: the pretrained model has {data.pretrained.size} parameters, the model "
                    f"{self.params.size}"
                )
            self._pm = data.pretrained.astype(np.float64)
            return
        from raysim.algorithms.crd import ContrastiveTransfer  # torch: on the coordinator only
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
        support = yield FullGradient(broadcast, s.support_split)
        phi = theta - s.alpha * support.grad  # (7)
        query = yield FullGradient(phi.astype(np.float32), s.query_split)
        r = query.grad.astype(np.float64)
        k = state.participations + 1
        g = np.zeros_like(theta)
        if s.hessian == "finite_difference":
            delta = self.delta(k)
            plus = yield FullGradient((theta + delta * r).astype(np.float32), s.support_split)
            minus = yield FullGradient((theta - delta * r).astype(np.float32), s.support_split)
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
        support = yield FullGradient(global_params, self.settings.support_split)
        return (global_params.astype(np.float64) - self.settings.alpha * support.grad).astype(np.float32)

    def regularizer_gradient(self, server: AugFlServerState) -> tuple[np.ndarray, CrdState | None, dict]:
        """grad_theta R_h(theta^t, theta_p) (eq. 13), the transfer state after it, and its metrics."""
        theta = server.theta.astype(np.float64)
        if not self.regularized():
            return np.zeros_like(theta), server.transfer, {}
        if self.settings.regularizer == "l2":
            if self._pm is None:
                raise RuntimeError("AugFL: setup_server was not called with the pretrained model")
            return 2.0 * (theta - self._pm), None, {}
        if self._transfer is None or server.transfer is None:
            raise RuntimeError("AugFL: setup_server was not called with the pretrained model and transfer set")
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
