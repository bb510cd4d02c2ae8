"""The algorithm interface: a client step and a server step over typed state.

An algorithm is plain Python over flat numpy vectors and knows nothing of Ray. The runtime only moves
its state and messages:

    broadcast = algorithm.broadcast(server)                       # coordinator, once per round
    update = client_step(client, state, broadcast)                # hosts, for each selected client
    total = sum of update.upload over the selected clients        # hosts sum, coordinator merges
    server, metrics = algorithm.server_step(server, total, n)     # coordinator

`client_step` is a generator: every piece of local training it needs (e.g. "H epochs of SGD on
f_i(theta) + lambda/2 ||theta - w_i||^2") is *yielded* as a `LocalSGD` request and the result is sent
back (`result = yield from train(request)` gives it typed; `gradient` likewise for a `FullGradient`,
`batch_gradients` for a `BatchGradients`: gradients at given points on one fresh mini-batch, for steps that run their
own loop). The algorithm thereby states *what* to optimise; the executor decides *how* (one client at a time, or many
clients at once): raysim.execution drives the generators (`run_client_step` with any executor, `run_client_steps`
several clients in lockstep, `run_stacked_step` a stacked chunk).
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

import numpy as np
from pydantic import ConfigDict, Field, field_validator

from raysim.examples import ExampleContext, Fragment
from raysim.models.losses import FeatureLoss, GatedHeads, GatedHeadsLoss, PrototypeContrast
from raysim.models.spec import ParamSpec
from raysim.registry import Registry
from raysim.settings import Settings

if TYPE_CHECKING:
    from typing_extensions import Self

    from raysim.data.dataset import Task

Vector = np.ndarray
"""A flat float32 parameter vector (see raysim.models.spec.ParamSpec for its layout)."""
Number = float | np.ndarray
"""A client's number (an upload's weight, a metric): a float or numpy scalar, or in a step over a ClientChunk a
[clients] array of them, one per row."""


class AlgorithmSettings(Settings):
    """Hyperparameters of one algorithm; subclasses add theirs. Validated from the config's `algorithm`."""

    model_config = ConfigDict(populate_by_name=True)
    name: str

    def at_round(self, round_index: int) -> Self:
        """The settings a client step of round `round_index` uses (`Algorithm.at_round`): these (see LrSchedule)."""
        return self


class LrSchedule(AlgorithmSettings):
    """A local learning rate `lr` that decays every round: eta_t = lr * lr_decay^t at round t (0-based), FedSLR's
    0.998^t (fedslr.md 6.3) for any method. The runtime hands each round's client steps the settings of that round
    (`at_round`), so a step reads its round's rates as `settings.lr` wherever it uses them (SGD requests, its own
    loops, control variates)."""

    lr: float
    lr_decay: float = Field(1.0, gt=0, le=1, description="eta_t = lr * lr_decay^t at round t; 1: a constant rate")
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr",)
    """The client-side rates that decay with `lr` (an unset optional one follows `lr` already)."""

    def at_round(self, round_index: int) -> Self:
        """These settings with every rate of `decayed_rates` times lr_decay^round_index."""
        if self.lr_decay == 1.0 or round_index == 0:
            return self
        factor = self.lr_decay**round_index
        rates = {name: getattr(self, name) for name in self.decayed_rates}
        return self.model_copy(update={name: rate * factor for name, rate in rates.items() if rate is not None})


class SGDSettings(LrSchedule):
    """Local mini-batch SGD, shared by the algorithms that train locally."""

    epochs: int = Field(1, ge=1, description="H: local passes over the client's training split per round")
    lr: float = Field(0.01, gt=0, description="eta: local learning rate (at round 0 with lr_decay)")
    batch_size: int = Field(100, ge=1)
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (0.5 in the FLAME authors' code)")
    weight_decay: float = Field(0.0, ge=0, description="extra L2 term mu*theta (0.01 in the FLAME authors' code)")
    random_epochs: bool = Field(
        False,
        description="each local training draws its passes uniformly from 1..epochs (per client and round, from the "
        "client's seeded stream) instead of always `epochs`: the FLAME authors' --fixed 0, E = random.randint(1, "
        "local_ep) (flame.md 9.7); an algorithm training several times a round draws for each",
    )
    loss_scale: Literal["1", "1/m"] = Field(
        "1",
        description="weight of the loss and its weight_decay term in the local objective: 1, or 1/m (m training "
        "clients) as the FedAPM authors' code divides every gradient, g = (1/m)(grad f_i + mu w) (fedapm.md 1.5); "
        "proximal, dual and linear terms stay unscaled. Step-matches a method with FedAPM at alpha_i = 1/m",
    )

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_one(cls, value: Any) -> Any:
        """`loss_scale: 1` as a YAML number means "1"."""
        return "1" if isinstance(value, int | float) and not isinstance(value, bool) and value == 1 else value

    def loss_factor(self, num_clients: int) -> float:
        """The loss weight that `loss_scale` gives with m = `num_clients` training clients."""
        return 1.0 / num_clients if self.loss_scale == "1/m" else 1.0

    def scaled(self, request: LocalSGD, num_clients: int) -> LocalSGD:
        """`request` with its loss weighted by `loss_scale` (see `scale_loss`)."""
        return scale_loss(request, self.loss_factor(num_clients))

    def effective_lr(self, num_clients: int, weighting: str) -> str:
        """The step on the unweighted loss f_i, lr times the loss's weight, as the run's parameters state it."""
        return f"{self.lr * self.loss_factor(num_clients):.6g}"

    def local_sgd(self, start: Vector, epochs: int | None = None, **objective: Any) -> LocalSGD:
        """A LocalSGD request with these hyperparameters; `objective` sets the prox/linear terms."""
        return LocalSGD(
            start=start,
            epochs=self.epochs if epochs is None else epochs,
            lr=self.lr,
            batch_size=self.batch_size,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            random_epochs=self.random_epochs,
            **objective,
        )


@dataclass(frozen=True)
class ClientInfo:
    """What a client step may know about its client."""

    id: int
    num_train: int
    weight: float
    """alpha_i: 1/m or n_i/n, from the config's `clients.weighting` (0 for a held-out client)."""
    num_clients: int
    """m, the number of training clients (ids 0..m-1)."""

    @property
    def heldout(self) -> bool:
        """A held-out (target) client: it never trains and is only evaluated (`clients.heldout`)."""
        return self.id >= self.num_clients

    @property
    def in_place(self) -> bool:
        """A single client's step never writes into its state's arrays (see ClientChunk.in_place)."""
        return False

    def may_write(self, keep: bool = False) -> bool:
        """Never: a single client's state is not donated (see ClientChunk.may_write)."""
        return False

    def writable(self, *arrays: np.ndarray, keep: bool = False) -> tuple[np.ndarray, ...]:
        """Copies of the state's `arrays` to write the new state into (see ClientChunk.writable)."""
        return tuple(array.copy() for array in arrays)


@dataclass(frozen=True)
class ClientChunk:
    """Several clients taken as one by a client step written over stacked state (`Algorithm.stacks`).

    Their vectors are the rows of [clients, n] arrays and each per-client number is a [clients] array (`per_row`
    shapes one to scale rows), so that the step's equations, written with broadcasting and reductions over the
    last axis (or with raysim.jit kernels over rows), run on one client's vectors (a ClientInfo) or on a chunk's
    rows alike."""

    clients: tuple[ClientInfo, ...]
    in_place: bool = False
    """The stacked state's arrays belong to this step: it may write the new state into them (and train in them,
    LocalSGD.in_place) instead of new arrays, as the runtime needs the old values no more (buffer donation)."""

    @property
    def id(self) -> np.ndarray:
        return np.array([c.id for c in self.clients], np.int64)

    @property
    def num_train(self) -> np.ndarray:
        return np.array([c.num_train for c in self.clients], np.int64)

    @property
    def weight(self) -> np.ndarray:
        """alpha_i of each client (float64, as exact as a ClientInfo's)."""
        return np.array([c.weight for c in self.clients], np.float64)

    @property
    def num_clients(self) -> int:
        return self.clients[0].num_clients

    def may_write(self, keep: bool = False) -> bool:
        """Whether the step may write into its state's arrays (and train in them, LocalSGD.in_place): the runtime
        donated them (`in_place`) and the step does not `keep` their old values to its end."""
        return self.in_place and not keep

    def writable(self, *arrays: np.ndarray, keep: bool = False) -> tuple[np.ndarray, ...]:
        """The state's `arrays`, to write the new state into: the arrays themselves when the step `may_write` into
        them, else copies."""
        return arrays if self.may_write(keep) else tuple(array.copy() for array in arrays)


def per_row(value: Number) -> np.ndarray:
    """A client's number, or a chunk's numbers [k], as float32 shaped to scale that client's vector or each row of
    the chunk's [k, n] arrays (a trailing axis of 1)."""
    return np.asarray(value, np.float32)[..., None]


@dataclass(frozen=True, eq=False)
class LocalSGD:
    """Request: mini-batch SGD from `start` on the client's training split, minimising

        f_i(offset + x) + (prox_weight/2) ||x - prox_center||^2 + <linear, x> + (weight_decay/2) ||x||^2
            + l1 ||x||_1 + nuclear sum_l ||W_l||_*
            + (projected_prox_weight/2) ||projection x - projected_prox_center||^2

    for `epochs` passes of shuffled mini-batches (the last batch may be smaller), or for `random_batches` steps on
    one random batch each, moving only the coordinates in `mask` when one is given.
    """

    start: Vector
    epochs: int
    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_weight: float = 0.0
    prox_center: Vector | None = None
    linear: Vector | None = None
    mask: np.ndarray | None = None
    """Boolean, parameter-sized: only these coordinates move (partial personalization phases, fedapm.md 1.5)."""
    offset: Vector | None = None
    """If given, f_i is evaluated at offset + x (FedSLR Phase II trains p with w_t frozen, fedslr.md eq. 7)."""
    l1: float | Vector | None = None
    """If given, proximal SGD for + l1 ||x||_1: soft-threshold at lr * l1 after every step (scalar or per entry)."""
    nuclear: float | None = None
    """If given, proximal SGD for + nuclear sum_l ||W_l||_* over the matrix (>= 2-D) parameters W_l, matrixized as
    raysim.algorithms.prox.matrixize: singular value thresholding of each at lr * nuclear after every step (and after
    the l1 step), the per-step proximal operator of FedSLR's LPGD ablation (fedslr.md A.2 eq. 18). An SVD per layer
    and step: the vectorized trainer runs such requests one client at a time. Not with `mask`."""
    random_batches: int | None = None
    """If given, instead of `epochs` passes: this many steps, each on one batch picked uniformly among the batches of
    a fresh shuffle of the split (the smaller last batch included), as `random.choice(list(trainloader))` does in
    the FLAME authors' code for Ditto's global copy (flame.md 11); momentum carries over between the steps."""
    projection: np.ndarray | None = None
    """P [d_sub, n], one matrix shared by every row of a chunk: with `projected_prox_weight` the proximal term pulls
    the projection P x towards `projected_prox_center` (Lp-Proj-2's lambda/2 ||P theta - w_i||^2, flame.md 2.5,
    whose gradient lambda P^T (P theta - w_i) enters every step)."""
    projected_prox_weight: float = 0.0
    projected_prox_center: Vector | None = None
    """[d_sub] (a chunk's: [k, d_sub] or one [d_sub] shared)."""
    loss: FeatureLoss | GatedHeadsLoss | PrototypeContrast | None = None
    """If given, the local loss on the features and logits that replaces f_i (vectors such as `prox_center` are then
    sized as `start`, which holds a second head too with FeatureLoss.second_head, or is a GatedHeads vector with a
    GatedHeadsLoss). A loss that draws noise (`loss.draws`) gets a seed from the client's stream at every step."""
    random_epochs: bool = False
    """If set, `epochs` is a maximum: the executor first draws the passes uniformly from 1..epochs with the request's
    generator (raysim.training.local.drawn_epochs), then the batches (SGDSettings.random_epochs)."""
    in_place: bool = False
    """The executor may train in `start`'s memory and return it as the result (the step needs the old values no
    more, ClientChunk.in_place); without it, or where it cannot, it trains a copy."""

    shared_fields: ClassVar[tuple[str, ...]] = ("projection",)
    """Matrix fields that one request of a chunk shares by every row (raysim.execution.stacking.unstack)."""

    def __post_init__(self) -> None:
        if self.prox_weight and self.prox_center is None:
            raise ValueError("LocalSGD: prox_weight > 0 needs a prox_center")
        if self.nuclear is not None and self.mask is not None:
            raise ValueError("LocalSGD: nuclear (a per-layer prox) cannot be combined with a mask")
        if self.projected_prox_weight and (self.projection is None or self.projected_prox_center is None):
            raise ValueError("LocalSGD: projected_prox_weight > 0 needs a projection and a projected_prox_center")
        if self.random_batches is not None and self.random_batches < 1:
            raise ValueError(f"LocalSGD: random_batches must be at least 1, got {self.random_batches}")
        if self.random_epochs and self.random_batches is not None:
            raise ValueError("LocalSGD: random_epochs draws passes; a random_batches request makes none")


def scale_loss(request: LocalSGD, factor: float) -> LocalSGD:
    """`request` on the objective factor * (f_i + weight_decay/2 ||x||^2) + the other terms unscaled, as SGD with
    lr * factor on the objective whose prox, projected prox, linear and l1 terms are divided by `factor`: the same
    iterates (with momentum too), and FedAPM's way of weighting its loss by alpha_i (raysim.algorithms.fedapm)."""
    if factor == 1.0:
        return request
    return dataclasses.replace(
        request,
        lr=request.lr * factor,
        prox_weight=request.prox_weight / factor,
        projected_prox_weight=request.projected_prox_weight / factor,
        linear=None if request.linear is None else request.linear / np.float32(factor),
        l1=None if request.l1 is None else request.l1 / np.float32(factor),
        nuclear=None if request.nuclear is None else request.nuclear / factor,
    )


@dataclass(frozen=True)
class CodeDraws:
    """A client's mini-batch draws per round in the FLAME authors' code (zsk66/FLAME update.py, flame.md 11):
    passes over its training split (a local epoch, or the `list(trainloader)` of a Ditto copy step) and
    `random.choice` picks among a pass's batches (raysim.training.authors_batches)."""

    passes: int
    picks: int = 0


@dataclass(frozen=True, eq=False)
class SGDResult:
    """A LocalSGD request's result; of a stacked request (a ClientChunk's), params [k, n] and [k] arrays."""

    params: Vector
    mean_loss: Number
    """Mean data loss f_i over the mini-batches seen (before each step)."""
    steps: int | np.ndarray


@dataclass
class Upload:
    """Base of the message types a client sends up.

    Subclasses are dataclasses whose fields are vectors or numbers. The runtime sums them field by
    field over the selected clients (exactly, in any order) and hands the server step that sum.

    Byzantine attacks and robust aggregation act on the *message* the paper says a client uploads
    (FLAME u_i, FedAvg the local model; flame.md 4.2). A subclass names the field that carries it:
    with `weight_field` (or none, weight 1) the field is weight * message (averaging servers); with
    `delta = True` it is message - previous message (running-sum servers whose global model is the
    mean of the m clients' latest messages, as FLAME's (14)).
    """

    message_field: ClassVar[str | None] = None
    weight_field: ClassVar[str | None] = None
    delta: ClassVar[bool] = False


U = TypeVar("U", bound=Upload)
C = TypeVar("C")  # client state
S = TypeVar("S")  # server state
B = TypeVar("B")  # broadcast
P = TypeVar("P", bound=AlgorithmSettings)


@dataclass
class ClientUpdate(Generic[C, U]):
    state: C
    upload: U
    metrics: Mapping[str, Number] = field(default_factory=dict)
    """Python floats once a driver has run the step (raysim.execution); [clients] float64 arrays in a chunk's."""
    message: Vector | None = None
    """The message this update sends, when the upload holds only a change of it (Upload.delta)."""


@dataclass(frozen=True, eq=False)
class FullGradient:
    """Request: the loss f_i and its full-batch gradient at `point` over one split of the client's data
    (AugFL's closed-form client step needs exact gradients on its support and query sets, augfl.md 1.6)."""

    point: Vector
    split: str = "train"
    """"train", "val" or "test": the ClientData index set the loss averages over."""
    indices: np.ndarray | None = None
    """If given, positions within the split: the loss averages over those samples only (a mini-batch of it)."""
    fraction: float = 1.0
    """Below 1: the loss averages over a random subset of the split (of `indices`, if given) of floor(fraction n)
    samples (at least one), drawn without replacement from the client's stream, in random order; the result's
    `indices` names them, so that later requests can take mini-batches of the same subset (FedALA's weight learning
    on a random share of the local data, raysim.algorithms.fedala)."""

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"FullGradient: fraction must be in (0, 1], got {self.fraction}")


@dataclass(frozen=True, eq=False)
class GradientResult:
    grad: Vector
    loss: float
    indices: np.ndarray | None = None
    """The positions within the split the request's `fraction` drew (None when it drew none)."""


@dataclass(frozen=True, eq=False)
class BatchGradients:
    """Request: the mean loss f_i and its gradient at each of `points`, all on ONE fresh mini-batch of the client's
    training split (min(batch_size, n_i) samples drawn uniformly without replacement, with the split's augmentation,
    noise and labels as a LocalSGD batch draws them).

    One request is one stochastic-gradient evaluation, so that a step that is not plain SGD on one objective runs
    its own loop over steps: Per-FedAvg's MAML step needs gradients at x and at the adapted x - alpha g on two
    batches, and its Hessian-free version a finite difference of gradients at x +- delta v on a third (both points
    on the same batch); APFL needs the gradients at its global and its mixed model on the same batch. Each request
    draws its batch from its own generator (as every request does), so the steps' batches are independent."""

    points: np.ndarray
    """[p, n]: p parameter vectors; a ClientChunk's request [k, p, n] (row i: client i's points)."""
    batch_size: int

    def __post_init__(self) -> None:
        if np.ndim(self.points) < 2:
            raise ValueError(f"BatchGradients: points must be [p, n] or [k, p, n], got shape {np.shape(self.points)}")
        if self.batch_size < 1:
            raise ValueError(f"BatchGradients: batch_size must be at least 1, got {self.batch_size}")


@dataclass(frozen=True, eq=False)
class BatchGradientsResult:
    """A BatchGradients request's result: grads [p, n] and losses [p] (a chunk's: [k, p, n] and [k, p]); an empty
    training split gives zero gradients and NaN losses."""

    grads: np.ndarray
    losses: np.ndarray


@dataclass(frozen=True, eq=False)
class ClassMeans:
    """Request: how many samples of each class one split of the client's data holds and, at `point`, the mean of
    their features z = f(x) (the head's input, ParamSpec.head) per class: a classifier's class prototypes (FedProto,
    Tan et al. 2022, eq. 5). Evaluation mode (no dropout, no augmentation); `point` None: the counts only (of the
    stored labels; for a client whose labels are redrawn, their expected counts)."""

    point: Vector | None
    split: str = "train"
    embedding: bool = False
    """Average the normalized head outputs z = h / ||h|| instead of the features (FedPCL's prototypes,
    raysim.models.losses.PrototypeContrast); d is then the head's output size."""
    """"train", "val" or "test": the ClientData index set to count and average over."""

    @property
    def draws(self) -> bool:
        """Whether it reads the client's randomness (redrawn noise or labels): not for the counts alone, which count
        the stored labels, so that asking for them takes no request number (`draws_randomness`) and leaves the
        draws of the step's other requests as they were."""
        return self.point is not None


@dataclass(frozen=True, eq=False)
class ClassMeansResult:
    counts: np.ndarray
    """[classes] float64: samples of each class in the split."""
    means: np.ndarray | None
    """[classes, d] float32: mean features of each class (zero for a class with no sample); None without a point."""


Request = LocalSGD | FullGradient | BatchGradients | ClassMeans
Result = SGDResult | GradientResult | BatchGradientsResult | ClassMeansResult
ClientStep = Generator[Request, Result, ClientUpdate[C, U]]
AdaptStep = Generator[Request, Result, Vector]


def train(request: LocalSGD) -> Generator[Request, Result, SGDResult]:
    """Yield a LocalSGD request and return its result: `result = yield from train(request)` in a step gives a typed
    SGDResult (a bare `yield` gives the union of every request's result)."""
    result = yield request
    if not isinstance(result, SGDResult):
        raise TypeError(f"a LocalSGD request was answered with a {type(result).__name__}, not an SGDResult")
    return result


def gradient(request: FullGradient) -> Generator[Request, Result, GradientResult]:
    """Yield a FullGradient request and return its result, typed (see `train`)."""
    result = yield request
    if not isinstance(result, GradientResult):
        raise TypeError(f"a FullGradient request was answered with a {type(result).__name__}, not a GradientResult")
    return result


def batch_steps(num_train: Number, batch_size: int, epochs: int, batches_per_step: int = 1) -> np.ndarray:
    """How many steps of `batches_per_step` BatchGradients batches make about `epochs` passes over a training split
    of `num_train` samples: epochs * ceil(n_i / batch_size) // batches_per_step, at least 1 where n_i > 0 (FL-bench's
    count for Per-FedAvg, len(trainloader) // 2 per epoch); an int array shaped like `num_train` (one per row)."""
    n = np.asarray(num_train, np.int64)
    steps = (epochs * (-(-n // batch_size))) // batches_per_step
    return np.where(n > 0, np.maximum(steps, 1), 0)


class LocalStepsSettings(LrSchedule):
    """Local work counted in steps that each draw fresh batches (BatchGradients: Per-FedAvg, APFL), not in passes."""

    batch_size: int = Field(100, ge=1, description="samples of each batch a step draws")
    epochs: int = Field(1, ge=1, description="local passes over the training split per round (sets local_steps)")
    local_steps: int | None = Field(
        None,
        ge=1,
        description="local steps per round; default epochs * ceil(n_i / batch_size) // the batches one step draws "
        "(APFL 1; Per-FedAvg 2 for FO, 3 for HF: FL-bench's count)",
    )

    def step_counts(self, num_train: Number, batches_per_step: int = 1) -> np.ndarray:
        """Local steps per round of a client (one per row of a chunk): `local_steps`, else `batch_steps`."""
        if self.local_steps is not None:
            return np.full(np.shape(num_train), self.local_steps, np.int64)
        return batch_steps(num_train, self.batch_size, self.epochs, batches_per_step)


def mean_over_steps(losses: Sequence[Number], steps: np.ndarray) -> np.ndarray:
    """Each row's mean of the losses of its own first `steps` steps (NaN without any), from the per-step losses of
    a loop that runs to the longest row's count (`batch_steps`)."""
    if not losses:
        return np.full(np.shape(steps), np.nan)
    seen = np.array(losses, np.float64)
    counted = np.arange(len(seen)).reshape(-1, *[1] * np.ndim(steps)) < steps
    total = np.where(counted, seen, 0.0).sum(axis=0)
    return np.where(steps > 0, total / np.maximum(steps, 1), np.nan)


def batch_gradients(request: BatchGradients) -> Generator[Request, Result, BatchGradientsResult]:
    """Yield a BatchGradients request and return its result, typed (see `train`)."""
    result = yield request
    if not isinstance(result, BatchGradientsResult):
        raise TypeError(
            f"a BatchGradients request was answered with a {type(result).__name__}, not a BatchGradientsResult"
        )
    return result


def draws_randomness(request: Request) -> bool:
    """Whether an executor gives the request the generator of the client's next request number (keyed by seed,
    client, round and that number): every request but a ClassMeans for the counts alone (ClassMeans.draws)."""
    return not isinstance(request, ClassMeans) or request.draws


def class_means(request: ClassMeans) -> Generator[Request, Result, ClassMeansResult]:
    """Yield a ClassMeans request and return its result, typed (see `train`)."""
    result = yield request
    if not isinstance(result, ClassMeansResult):
        raise TypeError(f"a ClassMeans request was answered with a {type(result).__name__}, not a ClassMeansResult")
    return result


@dataclass(frozen=True, eq=False)
class ServerSamples:
    """Samples that no client holds, kept back by the partition for the server's own use."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True, eq=False)
class ServerContext:
    """What the runtime tells an algorithm preparing its server data (`Algorithm.server_data`), in the driver
    before any Ray work."""

    partition: str
    """The partition's scheme (`partition.scheme`)."""
    pools: tuple[ServerSamples, ...]
    """The pools of samples the partition keeps back from every client for the server, in the scheme's order
    (see its `server_pools`); empty for a scheme that keeps none back."""
    dataset: str
    """The dataset's name (`dataset.name`), e.g. to key cached files."""
    model: str
    """The clients' (and global) model architecture, a raysim.models.zoo name."""
    input_shape: tuple[int, ...]
    num_classes: int
    """The models' output size (the number of classes for classification)."""
    task: Task
    seed: int
    """The experiment seed (`seed`)."""
    cache: Path
    """raysim's cache folder ($RAYSIM_CACHE, default ~/.cache/raysim); an algorithm keeps its files in a
    subfolder of its own."""


@dataclass(frozen=True, eq=False)
class TrainModel:
    """Request (server data only): train a fresh model of architecture `model` over the samples (x, y) instead of a
    client's training split, e.g. pretraining a model on a pool of `ServerContext.pools`: `epochs` passes of
    shuffled mini-batches of SGD from `start` as torch.optim.SGD steps (momentum, weight decay added to the
    gradient), the rate multiplied by `lr_decay` at the start of every epoch in `lr_steps` (torch's MultiStepLR)."""

    model: str
    """A raysim.models.zoo name; it may differ from the clients' model. Input shape and output size are the
    context's."""
    x: np.ndarray
    y: np.ndarray
    start: Vector
    epochs: int
    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_steps: tuple[int, ...] = ()
    lr_decay: float = 0.1

    def lr_at(self, epoch: int) -> float:
        """The rate of epoch `epoch` (0-based): lr times lr_decay per step already reached."""
        return self.lr * self.lr_decay ** sum(epoch >= step for step in self.lr_steps)


ServerDataStep = Generator[TrainModel, SGDResult, Any]
"""`Algorithm.server_data`: yields TrainModel requests, receives their results, returns the server data."""


class Algorithm(ABC, Generic[P, C, S, B, U]):
    """One federated algorithm. Subclasses set `name` and `Settings` and implement the steps."""

    name: ClassVar[str]
    Settings: ClassVar[type[AlgorithmSettings]]
    Upload: ClassVar[type[Upload]]
    stacks: ClassVar[bool] = False
    scales_loss: ClassVar[bool] = False
    """Its client step weights every local loss by `SGDSettings.loss_scale` (`SGDSettings.scaled`); the config
    refuses loss_scale 1/m for the others (FedAPM, FLAME and FedADMM weight their loss by alpha_i instead)."""
    """`client_step` also runs on a ClientChunk whose state is stacked (ClientChunk; raysim.execution.drivers):
    a vectorized host then updates a chunk of clients in a few array operations instead of one client at a time."""

    def __init__(self, settings: P, params: ParamSpec):
        self.settings = settings
        self.params = params
        """Layout of the flat parameter vector (names, shapes), for algorithms that act per layer."""

    def at_round(self, round_index: int) -> Self:
        """This algorithm as the client steps of round `round_index` run it: with `settings.at_round` (the round's
        learning rates, LrSchedule); itself when they are unchanged. The runtime steps every client with it."""
        settings = self.settings.at_round(round_index)
        if settings is self.settings:
            return self
        at_round = copy.copy(self)
        at_round.settings = settings
        return at_round

    @abstractmethod
    def init_server(self, init_params: Vector, num_clients: int) -> S:
        """Server state before round 0; every client starts from the same `init_params`."""

    @abstractmethod
    def init_client(self, client: ClientInfo, init_params: Vector) -> C:
        """Client state before round 0."""

    @abstractmethod
    def broadcast(self, server: S) -> B:
        """What the server sends to the selected clients this round."""

    @abstractmethod
    def client_step(self, client: ClientInfo, state: C, broadcast: B) -> ClientStep:
        """The local update of a selected client (a generator; see the module docstring)."""

    @abstractmethod
    def server_step(self, server: S, total: U, num_selected: int) -> tuple[S, dict[str, float]]:
        """The server update from the sum of the selected clients' uploads."""

    @classmethod
    def reads_messages(cls, settings: P) -> bool:
        """Whether, with these settings, the server step needs each selected client's own message by client id
        (`server_step_by_client`; FedSLR's per-client dual mirrors, Alg. 1/2): the hosts then send them beside the
        sum. Default: no, the sum is all the server reads."""
        return False

    def server_step_by_client(
        self, server: S, total: U, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[S, dict[str, float]]:
        """The server step of settings that `reads_messages`: `messages` maps each selected client's id to the
        message it sent (Algorithm.message). Default: `server_step`."""
        return self.server_step(server, total, num_selected)

    @abstractmethod
    def global_model(self, server: S) -> Vector:
        """The global model (GM) evaluated on every client."""

    def model_tables(self, global_params: Vector) -> dict[str, dict[str, list]]:
        """Tables describing the final global model, by name, each as columns (name -> equally long lists): the run
        logs each as the artifacts `<name>.parquet` and `<name>.json` (an MLflow table) when it ends (FedSLR:
        `spectra`, the singular values of every matrixized layer of the GKR). Default: none."""
        return {}

    def personalized_model(self, state: C) -> Vector | None:
        """The client's personalized model (PM); None means the client deploys the global model."""
        return None

    def evaluated_model(self, state: C, global_params: Vector) -> Vector | None:
        """The PM scored at evaluation, given the current global model (default: `personalized_model`)."""
        return self.personalized_model(state)

    def personalized_network(self) -> GatedHeads | None:
        """What the PMs are when they are not vectors of the network's parameters: a personalized model built around
        the network (raysim.models.losses.GatedHeads: FedCP's), whose vectors `composed_model` gives in place of
        `evaluated_model` and the hosts score with FlatModel.composed. Default None: the PM is the network's."""
        return None

    def composed_model(self, state: C, global_params: Vector, context: Any = None) -> Vector:
        """The PM as a vector of `personalized_network` (only asked of an algorithm that has one), given the current
        global model and `evaluation_context`."""
        raise NotImplementedError(f"algorithm {self.name!r} has no personalized network")

    def adapt(self, client: ClientInfo, global_params: Vector) -> AdaptStep | None:
        """How a held-out client (`clients.heldout`: it never trains) gets its model from the current global
        one at evaluation, as a generator of requests like `client_step` (AugFL: one gradient step on its
        support set, augfl.md 2.3); None: it deploys the global model."""
        return None

    def server_data(self, context: ServerContext) -> ServerDataStep | None:
        """The data only the coordinator holds (e.g. a pretrained model and its transfer set), prepared once in
        the driver before any Ray work, as a generator that yields `TrainModel` requests (the runtime runs them
        with the local trainer and sends the results back) and returns the algorithm's own server-data object;
        it reaches `setup_server` on the coordinator and never a client host. None (default): no server data."""
        return None

    def setup_server(self, data: Any) -> None:
        """Take the server data that `server_data` returned (called once, on the coordinator only)."""

    def evaluation_context(self, server: S) -> Any:
        """What the clients' models at evaluation need of the server state besides the global model (FedProto: the
        global prototypes, for nearest-prototype inference); the runtime sends it to every host with the global
        model and it reaches `extra_models`. Default: None."""
        return None

    def extra_models(self, state: C, global_params: Vector, context: Any = None) -> dict[str, Vector]:
        """Further per-client models to score at evaluation, by name (FedSLR: `personal`, p_i alone), given the
        global model and `evaluation_context`; each is summarized as `<name>/acc`, `<name>/loss`, ... like PM and
        GM. Default: none."""
        return {}

    def uplink_bytes(self, upload: U) -> int:
        """Bytes one client sends for `upload`: its vectors and numbers as float32 (override for compression)."""
        return payload_bytes(upload)

    def downlink_bytes(self, broadcast: B) -> int:
        """Bytes each selected client receives for `broadcast`, as float32 (override for factorized models)."""
        return payload_bytes(broadcast)

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """The config sections under which this algorithm runs in a small experiment (raysim.examples): its default
        settings; an algorithm that cannot run without other settings (a partition, a dataset) names them too."""
        return {"algorithm": {"name": cls.name}}

    @classmethod
    def code_draws(cls, settings: P) -> CodeDraws | None:
        """The mini-batch draws a client makes per round in the FLAME authors' code for these settings, in the
        order this algorithm's requests make them (`clients.batches: authors` replays them); None (default): no
        such code, or settings whose draws differ from it."""
        return None

    @classmethod
    def sends_messages(cls) -> bool:
        """Whether attacks and robust aggregation can act on this algorithm's uploads (see Upload)."""
        return cls.Upload.message_field is not None

    def message_coordinates(self, params: Vector) -> Vector:
        """The part of a full parameter vector that messages carry (all of it, unless the algorithm shares
        only part of the model); the coordinator uses it for the initial messages and the clipping centre."""
        return params

    def message(self, update: ClientUpdate) -> Vector:
        """The message an update sends: `update.message`, else the weighted upload field / its weight."""
        upload = update.upload
        if update.message is not None:
            return update.message
        if upload.message_field is None or upload.delta:
            raise NotImplementedError(f"algorithm {self.name!r}: set Upload.message_field and ClientUpdate.message")
        weight = getattr(upload, upload.weight_field) if upload.weight_field else 1.0
        return np.asarray(getattr(upload, upload.message_field), dtype=np.float64) / weight

    def previous_message(self, update: ClientUpdate) -> Vector | None:
        """For delta uploads, the message the server held for this client before the update."""
        upload = update.upload
        return self.message(update) - getattr(upload, upload.message_field) if upload.delta else None

    def upload_from_message(self, upload: U, message: Vector, previous: Vector | None = None) -> U:
        """`upload` changed to send `message` instead; `previous` is the client's last sent message (delta)."""
        if upload.message_field is None:
            raise NotImplementedError(f"algorithm {self.name!r}: its Upload names no message_field")
        if upload.delta:
            if previous is None:
                raise ValueError(f"algorithm {self.name!r}: a delta upload needs the client's previous message")
            value = np.asarray(message, dtype=np.float64) - previous
        else:
            weight = getattr(upload, upload.weight_field) if upload.weight_field else 1.0
            value = weight * np.asarray(message, dtype=np.float64)
        return dataclasses.replace(upload, **{upload.message_field: value})


def _check_algorithm(name: str, entry: type[Algorithm]) -> None:
    """An algorithm class whose Settings answer to its name (`algorithm.name` chooses them)."""
    if not (isinstance(entry, type) and issubclass(entry, Algorithm)):
        raise TypeError(f"algorithm {name!r}: {entry!r} is not a subclass of raysim.algorithms.base.Algorithm")
    settings = getattr(entry, "Settings", None)
    if not (isinstance(settings, type) and issubclass(settings, AlgorithmSettings)):
        raise TypeError(f"algorithm {name!r}: {entry.__name__}.Settings must subclass AlgorithmSettings")
    if settings.model_fields["name"].default != name:
        raise TypeError(
            f"algorithm {name!r}: {entry.__name__}.Settings must declare name: Literal[{name!r}] = {name!r}"
        )


ALGORITHMS: Registry[type[Algorithm]] = Registry(
    "algorithm", "algorithm.name", settings=lambda entry: entry.Settings, check=_check_algorithm
)
"""The algorithms by `algorithm.name`: each registers with `@ALGORITHMS.register()` (its `name`), a plugin's too."""


NOT_SENT = {"sent": False}
"""Dataclass field metadata of a field that rides in an upload for the runtime to sum but is not communication
(`field(metadata=NOT_SENT)`: e.g. a diagnostic); payload_bytes does not count it."""


def payload_bytes(payload: object) -> int:
    """Size of a message sent as float32: arrays, numbers, and dataclasses (but their NOT_SENT fields) / sequences
    of them; None is 0."""
    if payload is None:
        return 0
    if isinstance(payload, np.ndarray):
        return 4 * payload.size
    if isinstance(payload, int | float | np.number):
        return 4
    if dataclasses.is_dataclass(payload):
        fields = [f for f in dataclasses.fields(payload) if f.metadata.get("sent", True)]
        return sum(payload_bytes(getattr(payload, f.name)) for f in fields)
    if isinstance(payload, tuple | list):
        return sum(payload_bytes(item) for item in payload)
    raise TypeError(f"payload_bytes: cannot size a {type(payload).__name__}; override uplink/downlink_bytes")
