"""The terms of a client's local objective: a LocalSGD request minimizes its data loss f_i plus its terms.

Each term says how it enters one SGD step, and both trainers loop over a request's terms without knowing any by name:

- a smooth term adds its gradient at x to the step's gradient (`add_gradient`);
- a non-smooth term maps the point after the step (`proximal`: its proximal operator at the step's rate);
- a term may move the point f_i is evaluated at (`evaluated_at`: FedSLR's p with w frozen, f_i(w + p));
- a loss term replaces f_i on the batch by a loss of its own on the model's features and logits (`loss`:
  FedProto's prototype pull, FedRoD's balanced softmax, FedCP's gated heads, FedPCL's contrast, distillation).

The sequential trainer (raysim.training.local) calls these on one client's vector. The vectorized trainer
(raysim.training.vectorized) trains a chunk's rows in one loop: it asks a term for its form over the rows
(`stacked`, a `StackedTerm` acting on per-layer views [clients, *shape]), or, for a term that declares
`batched = False`, trains the request one client at a time. A term is a frozen dataclass: its `rows` fields are a
client's vectors ([n], and in a chunk's request [k, n] or one [n] shared by every row), its `shared` fields one
array every row of a chunk shares, its other fields numbers that requests training together have in common (`key`).

A method whose local objective needs a term of its own defines it beside the method, in its own module; a plugin in
its own file. torch is imported where a step runs, never at import: the coordinator imports every algorithm module
and loads torch only when its server step needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

    from raysim.models.flat import FlatModel

    Layers = dict[str, torch.Tensor]


class StackedTerm:
    """A term over the rows of a chunk's request, as the vectorized trainer's update runs it layer by layer on the
    clients still training (the first rows: `active`). The update of a layer's parameters p with gradient g is

        g' = g + (weight_decay + sum of the terms' `decay`) p + the terms' `add_constant`s     (in the terms' order)
        p  = p - lr g',  then each term's `after_step`

    so a term whose gradient is affine in x, a x + b, declares a as `decay` and adds b. `before_step` sees the whole
    rows before a step (a gradient that mixes layers, ProjectedProx's), `shift` the point f_i is evaluated at."""

    decay: float = 0.0
    """The coefficient a of x in the term's gradient."""

    def before_step(self, flat: torch.Tensor) -> None:
        """Before each step, with the active rows [active, n] (the chunk's flat parameters)."""

    def add_constant(self, name: str, target: torch.Tensor, scale: float) -> None:
        """target += scale * (the part of the gradient of layer `name` that is not `decay` x), for the first
        len(target) rows."""

    def after_step(self, name: str, p: torch.Tensor, frozen: torch.Tensor | None) -> None:
        """After the step of layer `name` (the first len(p) rows), in place; `frozen`: the coordinates that must not
        move (LocalSGD.mask), or None."""

    def shift(self) -> Layers | None:
        """Per layer, what f_i's point is shifted by (f_i at shift + x), or None."""
        return None


@dataclass(frozen=True)
class RowsContext:
    """What a term's stacked form is built from (the vectorized trainer gives it)."""

    count: int
    """The chunk's rows."""
    size: int
    """n, the model's parameters."""
    lr: float
    layers: Callable[..., Layers | None]
    """`layers(vectors, dtype=torch.float32)`: a request's [k, n] rows, or one [n] vector shared by every row, as
    per-layer views [k, *shape] on the trainer's device (None for None)."""
    unflatten: Callable[[Any], Layers]
    """The per-layer views of a flat [k, n] tensor."""
    device: Any
    """The trainer's torch device."""


@dataclass(frozen=True, eq=False)
class Term:
    """One term of a client's local objective beyond f_i (see the module docstring). Subclasses override the
    parts of one step they change."""

    batched: ClassVar[bool] = True
    """The vectorized trainer runs the term over a chunk's rows (`stacked`); False: a request with it trains one
    client at a time."""
    rows: ClassVar[tuple[str, ...]] = ()
    """Fields holding a client's vector (or a number, for every coordinate)."""
    shared: ClassVar[tuple[str, ...]] = ()
    """Fields holding one array that every row of a chunk shares."""
    replaces_loss: ClassVar[bool] = False
    """`loss` gives the step's loss in place of f_i's (at most one such term a request)."""

    def model_window(self, model: FlatModel) -> slice:
        """Where the model's own parameters sit in the vector a loss term trains: a term that trains the model with
        parts of its own (a personal head after it, a policy network before it) says so, so that the trainer
        finds the model's running statistics (BatchNorm) in the vector."""
        return slice(0, model.size)

    @property
    def draws(self) -> bool:
        """Whether the term draws noise of its own at every step: the step's seed (from the client's stream) then
        reaches `loss`, as dropout's does."""
        return False

    def scaled(self, factor: float) -> Self:
        """The term divided by `factor` (raysim.algorithms.requests.scale_loss); a part of the loss stays as it is."""
        return self

    def tensor(self, name: str) -> torch.Tensor:
        """The term's field `name` as a float32 torch tensor, made once per term (a request's term serves all its
        steps; the arrays may be read-only views of Ray's object store, which torch must not alias)."""
        return _cached_tensor(self, name)

    def evaluated_at(self, x: torch.Tensor) -> torch.Tensor:
        """The point f_i is evaluated at, for the parameters x."""
        return x

    def loss_and_grad(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> tuple[float, torch.Tensor]:
        """A loss term's loss on the batch (x, y) at `point` and its gradient (a new flat tensor; zero where the loss
        does not depend on the point); `seed` seeds the network's dropout and the term's own noise (None: neither)."""
        import torch

        point = point.detach().requires_grad_(True)
        total = self.loss(model, point, x, y, seed)
        (grad,) = torch.autograd.grad(total, point, allow_unused=True)
        return total.item(), torch.zeros_like(point) if grad is None else grad

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        """A loss term's loss on the batch (x, y) as a differentiable function of `point` (`loss_and_grad` takes its
        gradient); what a loss term overrides."""
        raise NotImplementedError(f"{type(self).__name__} is not a loss term")

    def add_gradient(self, grad: torch.Tensor, x: torch.Tensor) -> None:
        """grad += the term's gradient at x (one client's vectors), in place."""

    def proximal(self, x: torch.Tensor, lr: float, model: FlatModel) -> torch.Tensor:
        """The point after the step x: the term's proximal map at rate lr (a new tensor, or x)."""
        return x

    def stacked(self, rows: RowsContext) -> StackedTerm:
        """The term over a chunk's rows (only asked of a `batched` term)."""
        raise NotImplementedError(f"{type(self).__name__} declares batched but has no stacked form")

    def key(self) -> tuple:
        """What requests training together in one lockstep loop must share: the term's kind, its numbers and its
        shared arrays (by identity)."""
        numbers = tuple(
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in self.rows + self.shared and not isinstance(getattr(self, f.name), np.ndarray)
        )
        row_scalars = tuple((name, getattr(self, name)) for name in self.rows if np.ndim(getattr(self, name)) == 0)
        return (type(self), numbers, row_scalars, tuple(id(getattr(self, name)) for name in self.shared))

    @classmethod
    def stack(cls, terms: Sequence[Self], width: int) -> Self:
        """Terms of one kind (equal `key`s) as one term over their rows: each `rows` vector field a [k, n] array
        (`width` n), a number shared; the first term's other fields."""
        first = terms[0]
        vectors = {}
        for name in cls.rows:
            values = [getattr(term, name) for term in terms]
            if values[0] is not None and np.ndim(values[0]) > 0:
                size = np.shape(values[0])[-1] if np.ndim(values[0]) else width
                vectors[name] = np.stack([np.broadcast_to(np.asarray(v), (size,)) for v in values])
        return dataclasses.replace(first, **vectors)

    def row(self, index: int) -> Self:
        """The term of row `index` of a chunk's term (a [n] vector field shared by every row stays as it is)."""
        vectors = {
            name: np.asarray(getattr(self, name))[index] for name in self.rows if np.ndim(getattr(self, name)) == 2
        }
        return dataclasses.replace(self, **vectors) if vectors else self

    def rows_of(self, order: np.ndarray) -> Self:
        """The chunk's term with its [k, n] rows permuted by `order`."""
        vectors = {
            name: np.asarray(getattr(self, name))[order] for name in self.rows if np.ndim(getattr(self, name)) == 2
        }
        return dataclasses.replace(self, **vectors) if vectors else self


def _tensor(array: Any) -> torch.Tensor:
    """A float32 copy of a vector as a tensor: arrays may be read-only views of Ray's object store, which torch
    must not alias."""
    import torch

    return torch.from_numpy(np.array(array, dtype=np.float32))


@dataclass(frozen=True, eq=False)
class Prox(Term):
    """(weight/2) ||x - center||^2: the proximal pull of FLAME (1/2 lambda ||theta - w_i||^2), FedProx, pFedMe,
    Ditto, FedADMM's and FedAPM's augmented terms, FedDyn's."""

    center: np.ndarray
    weight: float
    rows: ClassVar[tuple[str, ...]] = ("center",)

    def scaled(self, factor: float) -> Self:
        return dataclasses.replace(self, weight=self.weight / factor)

    def add_gradient(self, grad: torch.Tensor, x: torch.Tensor) -> None:
        if self.weight:
            grad.add_(x - self._center, alpha=self.weight)

    def stacked(self, rows: RowsContext) -> StackedTerm:
        return _StackedProx(self.weight, rows.layers(self.center) if self.weight else None)

    @property
    def _center(self) -> torch.Tensor:
        return _cached_tensor(self, "center")


class _StackedProx(StackedTerm):
    """weight (x - center) = weight x - weight center: `decay` weight, the constant -weight center."""

    def __init__(self, weight: float, center: Layers | None):
        self.decay = weight
        self.center = center

    def add_constant(self, name: str, target: torch.Tensor, scale: float) -> None:
        if self.center is not None:
            target.add_(self.center[name][: len(target)], alpha=-scale * self.decay)


@dataclass(frozen=True, eq=False)
class Linear(Term):
    """<vector, x>: a dual variable's or a control variate's term (FedADMM's pi_i, FedAPM's, FedDyn's -gamma,
    SCAFFOLD's c - c_i)."""

    vector: np.ndarray
    rows: ClassVar[tuple[str, ...]] = ("vector",)

    def scaled(self, factor: float) -> Self:
        return dataclasses.replace(self, vector=self.vector / np.float32(factor))

    def add_gradient(self, grad: torch.Tensor, x: torch.Tensor) -> None:
        grad.add_(_cached_tensor(self, "vector"))

    def stacked(self, rows: RowsContext) -> StackedTerm:
        return _StackedLinear(rows.layers(self.vector))


class _StackedLinear(StackedTerm):
    def __init__(self, vector: Layers | None):
        self.vector = vector

    def add_constant(self, name: str, target: torch.Tensor, scale: float) -> None:
        if self.vector is not None:
            target.add_(self.vector[name][: len(target)], alpha=scale)


@dataclass(frozen=True, eq=False)
class ProjectedProx(Term):
    """(weight/2) ||projection x - center||^2 with one matrix P [d_sub, n] for every row of a chunk: Lp-Proj-2's
    lambda/2 ||P theta - w_i||^2 (FLAME, Appendix C, Algorithm 2), whose gradient weight P^T (P x - center) enters
    every step."""

    projection: np.ndarray
    center: np.ndarray
    """[d_sub] (a chunk's: [k, d_sub] or one [d_sub] shared)."""
    weight: float
    rows: ClassVar[tuple[str, ...]] = ("center",)
    shared: ClassVar[tuple[str, ...]] = ("projection",)

    def scaled(self, factor: float) -> Self:
        return dataclasses.replace(self, weight=self.weight / factor)

    def add_gradient(self, grad: torch.Tensor, x: torch.Tensor) -> None:
        if self.weight:
            projection = _cached_tensor(self, "projection")
            grad.add_(projection.T @ (projection @ x - _cached_tensor(self, "center")), alpha=self.weight)

    def stacked(self, rows: RowsContext) -> StackedTerm:
        return _StackedProjectedProx(self, rows)


class _StackedProjectedProx(StackedTerm):
    """The gradient weight P^T (P x - c) of the active rows, from the flat rows before the step."""

    def __init__(self, term: ProjectedProx, rows: RowsContext):
        import torch

        self.weight = term.weight
        self.unflatten = rows.unflatten
        self.projection = torch.from_numpy(np.array(term.projection, np.float32)).to(rows.device)
        center = torch.from_numpy(np.array(term.center, np.float32)).to(rows.device)
        self.center = center.expand(rows.count, -1) if center.ndim == 1 else center
        self.step: Layers | None = None

    def before_step(self, flat: torch.Tensor) -> None:
        if self.weight:
            residual = flat @ self.projection.T - self.center[: len(flat)]
            self.step = self.unflatten(self.weight * (residual @ self.projection))

    def add_constant(self, name: str, target: torch.Tensor, scale: float) -> None:
        if self.step is not None:
            target.add_(self.step[name][: len(target)], alpha=scale)


@dataclass(frozen=True, eq=False)
class L1(Term):
    """weight ||x||_1, by proximal SGD: soft-thresholding at lr * weight after every step, only where the request
    moves coordinates (LocalSGD.mask); `weight` a number or one per coordinate (FedSLR's sparse p_i, its eq. (7))."""

    weight: float | np.ndarray
    rows: ClassVar[tuple[str, ...]] = ("weight",)

    def scaled(self, factor: float) -> Self:
        return dataclasses.replace(self, weight=self.weight / np.float32(factor))

    def proximal(self, x: torch.Tensor, lr: float, model: FlatModel) -> torch.Tensor:
        from raysim.algorithms.prox import soft_threshold

        return soft_threshold(x, lr * _cached_tensor(self, "weight"))

    def stacked(self, rows: RowsContext) -> StackedTerm:
        return _StackedL1(self, rows)


class _StackedL1(StackedTerm):
    def __init__(self, term: L1, rows: RowsContext):
        weight = term.weight
        if np.ndim(weight) < 2:  # a number, or one vector shared by every row
            weight = np.broadcast_to(np.asarray(weight, np.float32), (rows.size,))
        per_layer = rows.layers(weight)
        assert per_layer is not None  # layers of an array
        self.threshold = {name: rows.lr * value for name, value in per_layer.items()}

    def after_step(self, name: str, p: torch.Tensor, frozen: torch.Tensor | None) -> None:
        import torch

        from raysim.algorithms.prox import soft_threshold

        shrunk = soft_threshold(p, self.threshold[name][: len(p)])
        p.copy_(shrunk if frozen is None else torch.where(frozen, p, shrunk))


@dataclass(frozen=True, eq=False)
class Nuclear(Term):
    """weight sum_l ||W_l||_* over the matrix (>= 2-D) parameters W_l, matrixized as raysim.algorithms.prox.matrixize:
    singular value thresholding of each at lr * weight after every step, the per-step proximal operator of FedSLR's
    LPGD ablation (FedSLR, Appendix A.2, eq. (18)). An SVD per layer and step: one client at a time. Not with a mask."""

    weight: float
    batched: ClassVar[bool] = False

    def scaled(self, factor: float) -> Self:
        return dataclasses.replace(self, weight=self.weight / factor)

    def proximal(self, x: torch.Tensor, lr: float, model: FlatModel) -> torch.Tensor:
        import torch

        from raysim.algorithms.prox import layerwise_svt

        return torch.from_numpy(layerwise_svt(x.numpy(), model.spec, lr * self.weight).params)


@dataclass(frozen=True, eq=False)
class Offset(Term):
    """f_i evaluated at offset + x (FedSLR's Phase II trains p with w_t frozen, its eq. (7))."""

    offset: np.ndarray
    rows: ClassVar[tuple[str, ...]] = ("offset",)

    def evaluated_at(self, x: torch.Tensor) -> torch.Tensor:
        return _cached_tensor(self, "offset") + x

    def stacked(self, rows: RowsContext) -> StackedTerm:
        return _StackedOffset(rows.layers(self.offset))


class _StackedOffset(StackedTerm):
    def __init__(self, offset: Layers | None):
        self.offset = offset

    def shift(self) -> Layers | None:
        return self.offset


@dataclass(frozen=True, eq=False)
class Distillation(Term):
    """Knowledge distillation (Hinton et al. 2015) from a teacher of the client's own architecture, in place of f_i:

        (1 - weight) CE(s(x), y) + weight T^2 KL(softmax(t(x) / T) || softmax(s(x) / T))

    with s the student's logits at the point trained and t the teacher's (its dropout off), T the `temperature`;
    `weight` = 0 is plain cross-entropy. The teacher is one vector that every row of a chunk shares (the global
    model, a server-side generator's: FedGen, FedKD-style methods); a request with it trains one client at a
    time."""

    teacher: np.ndarray
    """The teacher's flat parameters ([n], the student's layout)."""
    weight: float = 0.5
    temperature: float = 1.0
    shared: ClassVar[tuple[str, ...]] = ("teacher",)
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch.nn import functional

        if model.task != "classification":
            raise ValueError(f"Distillation needs a classifier; model {model.name!r} is trained for {model.task}")
        with torch.no_grad():
            taught = model.forward(_cached_tensor(self, "teacher"), x)
        with model.dropout(seed):
            logits = model.forward(point, x)
        scale = self.temperature
        soft = tempered_kl(logits, taught, scale)
        total = (1 - self.weight) * functional.cross_entropy(logits, y) + self.weight * scale**2 * soft
        return total


def tempered_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)), the batch mean: what a distillation term adds (scaled by
    T^2 by the caller)."""
    from torch.nn import functional

    return functional.kl_div(
        functional.log_softmax(student / temperature, dim=1),
        functional.log_softmax(teacher / temperature, dim=1),
        log_target=True,
        reduction="batchmean",
    )


def _cached_tensor(term: Term, name: str) -> torch.Tensor:
    """The term's field `name` as a float32 tensor, made once per term (a request's term serves all its steps)."""
    cache = term.__dict__.setdefault("_tensors", {})
    if name not in cache:
        cache[name] = _tensor(getattr(term, name))
    return cache[name]


def loss_term(terms: Sequence[Term]) -> Term | None:
    """The one term of `terms` that replaces f_i, or None."""
    found = [term for term in terms if term.replaces_loss]
    if len(found) > 1:
        raise ValueError(f"LocalSGD: at most one loss term, got {', '.join(type(t).__name__ for t in found)}")
    return found[0] if found else None
