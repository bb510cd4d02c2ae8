"""What a client step may ask its executor for, and the results it gets back.

A client step is a generator: every piece of local work it needs is *yielded* as a request and the result is sent
back. `LocalSGD`: "H epochs of SGD on f_i + the request's terms" (raysim.algorithms.terms); `FullGradient`: the loss
and gradient over a split; `BatchGradients`: gradients at given points on one fresh mini-batch, for steps that run
their own loop; `ClassMeans`: per-class counts and mean features. `result = yield from train(request)` gives a typed
result (`gradient`, `batch_gradients`, `class_means` likewise). The algorithm states *what* to compute; the executor
decides *how* (raysim.execution: one client at a time, several in lockstep, a stacked chunk). `TrainModel` is the
server data's one request (Algorithm.server_data).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from raysim.algorithms.terms import Nuclear, Term, loss_term

T = TypeVar("T", bound=Term)

if TYPE_CHECKING:
    pass


Vector = np.ndarray
"""A flat float32 parameter vector (see raysim.models.spec.ParamSpec for its layout)."""


Number = float | np.ndarray
"""A client's number (an upload's weight, a metric): a float or numpy scalar, or in a step over a ClientChunk a
[clients] array of them, one per row."""


@dataclass(frozen=True, eq=False)
class LocalSGD:
    """Request: mini-batch SGD from `start` on the client's training split, minimising

        f_i(x) + (weight_decay/2) ||x||^2 + the request's terms (raysim.algorithms.terms)

    for `epochs` passes of shuffled mini-batches (the last batch may be smaller), or for `random_batches` steps on
    one random batch each, moving only the coordinates in `mask` when one is given. A step takes the gradient of
    f_i (or of the one loss term that replaces it) at the point the terms say, adds weight_decay x and each smooth
    term's gradient in order, keeps the frozen coordinates' at 0, folds in momentum, steps, then applies each
    non-smooth term's proximal map in order.
    """

    start: Vector
    epochs: int
    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    terms: tuple[Term, ...] = ()
    """The local objective's terms beyond f_i, in the order their gradients are added and their maps applied."""
    mask: np.ndarray | None = None
    """Boolean, parameter-sized: only these coordinates move (partial personalization phases, the authors' code)."""
    random_batches: int | None = None
    """If given, instead of `epochs` passes: this many steps, each on one batch picked uniformly among the batches of
    a fresh shuffle of the split (the smaller last batch included), as `random.choice(list(trainloader))` does in
    the FLAME authors' code for Ditto's global copy; momentum carries over between the steps."""
    random_epochs: bool = False
    """If set, `epochs` is a maximum: the executor first draws the passes uniformly from 1..epochs with the request's
    generator (raysim.training.local.drawn_epochs), then the batches (SGDSettings.random_epochs)."""
    in_place: bool = False
    """The executor may train in `start`'s memory and return it as the result (the step needs the old values no
    more, ClientChunk.in_place); without it, or where it cannot, it trains a copy."""

    def __post_init__(self) -> None:
        if not all(isinstance(term, Term) for term in self.terms):
            raise TypeError(f"LocalSGD: terms must be raysim.algorithms.terms.Term objects, got {self.terms!r}")
        loss_term(self.terms)  # at most one
        if self.mask is not None and any(isinstance(term, Nuclear) for term in self.terms):
            raise ValueError("LocalSGD: a nuclear term (a per-layer prox) cannot be combined with a mask")
        if self.random_batches is not None and self.random_batches < 1:
            raise ValueError(f"LocalSGD: random_batches must be at least 1, got {self.random_batches}")
        if self.random_epochs and self.random_batches is not None:
            raise ValueError("LocalSGD: random_epochs draws passes; a random_batches request makes none")

    def term(self, kind: type[T]) -> T | None:
        """The request's term of type `kind`, or None (exact solvers in tests read the objective this way)."""
        return next((term for term in self.terms if isinstance(term, kind)), None)

    @property
    def batched(self) -> bool:
        """Whether the vectorized trainer can run a chunk's rows of this request in one lockstep loop: every term has
        a stacked form and the steps are whole passes."""
        return self.random_batches is None and all(term.batched for term in self.terms)

    @property
    def draws(self) -> bool:
        """Whether a step draws noise of its own (a term's), besides dropout's."""
        return any(term.draws for term in self.terms)


def scale_loss(request: LocalSGD, factor: float) -> LocalSGD:
    """`request` on the objective factor * (f_i + weight_decay/2 ||x||^2) + its terms unscaled, as SGD with
    lr * factor on the objective whose terms are divided by `factor` (Term.scaled): the same iterates (with momentum
    too), and FedAPM's way of weighting its loss by alpha_i (raysim.algorithms.fedapm)."""
    if factor == 1.0:
        return request
    return dataclasses.replace(
        request, lr=request.lr * factor, terms=tuple(term.scaled(factor) for term in request.terms)
    )


@dataclass(frozen=True, eq=False)
class SGDResult:
    """A LocalSGD request's result; of a stacked request (a ClientChunk's), params [k, n] and [k] arrays."""

    params: Vector
    mean_loss: Number
    """Mean data loss f_i over the mini-batches seen (before each step)."""
    steps: int | np.ndarray


@dataclass(frozen=True, eq=False)
class FullGradient:
    """Request: the loss f_i and its full-batch gradient at `point` over one split of the client's data
    (AugFL's closed-form client step needs exact gradients on its support and query sets, AugFL, eqs. (7)-(13))."""

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
    raysim.algorithms.fedpcl.PrototypeContrast); d is then the head's output size."""
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
